// Our own fp8 expert GEMMs of the forward (expert_gemm_sm90.cuh): one persistent launch over the
// whole pool, row-grouped like grouped_gemm.h (group g owns pool rows [group_ends[g-1],
// group_ends[g])), with epilogues fused in:
// - expert_gemm_swiglu (L1): out = the pre-activations (bf16 [P, N], N = 2I, gate/up interleaved
//   in `chunk`-row chunks as B is), act = e4m3(silu(min(g, c)) * clamp(u, -c, c) * row_weight)
//   [P, I] with one fp32 scale per 1x128 block (act_scales [P, I/128]);
// - expert_gemm (L2, dgrads): out = bf16 [P, N].
// A e4m3 [P, K] with a_scales fp32 [P, K/128]; B e4m3 [G, N, K] with b_scales fp32
// [G, N/128, K/128]; D[rows of g] = (A * a_scales)[rows] @ (B[g] * b_scales[g])^T, the scales
// applied per 128-deep K block in fp32. Rows past group_ends[G-1] and the rows of a group's last
// tile past its end are left untouched. group_ends lives on the device: no host sync, capturable.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megamoe {

struct ExpertGemmArgs {
  const void* a;
  const float* a_scales;
  const void* b;
  const float* b_scales;
  const int32_t* group_ends;
  const uint8_t* b_shifts;   // expert_gemm_mx only
  void* out;
  const float* row_weights;  // SwiGLU only
  void* act;                 // SwiGLU only
  float* act_scales;         // SwiGLU only
  int num_groups;
  int pool_rows;
  int n;
  int k;
  int chunk;                 // SwiGLU only
  float clamp;               // SwiGLU only, used where has_clamp
  bool has_clamp;
  // bit 0 set: no CTA clusters (else 2-CTA clusters share A where a tile has an even block count);
  // bit 1 set: the first schedule (epilogue after each block, stored from the fragments), else
  // the staged one (epilogue under the next block's wgmmas, rows copied out of shared memory);
  // bit 2 set (staged only): the math warpgroups not staggered by a K block;
  // bit 3 set (SwiGLU, staged only): the up block's epilogue in place at the block's end (the
  // 2026-12-03 schedule), else deferred into passes of 8 rows under the next unit's wgmmas;
  // bit 4 set: a tile's 64-row halves (a pair CTA's shares) wholly past the group's end are not
  // loaded, and on the staged schedule their math warpgroup issues no wgmma (same bits);
  // bit 5 set (expert_gemm_mx only): the math warpgroups share the E2M1 expansion (same bits)
  int variant;
  void* stream;
  int device;
};

// All return an empty string on success, else what went wrong.
const char* expert_gemm(const ExpertGemmArgs& args);
// expert_gemm with B the MX recipe's E2M1 weights as stored (packed uint8 [G, N, K/2], 4 bits in
// HBM) expanded to e4m3 in shared memory: b_shifts uint8 [G, N/128, K/128, 128, 4] and b_scales
// fp32 [G, N/128, K/128] from quant.mx_weight_shifts; the same bits as expert_gemm on
// quant.fold_mx_weight's e4m3 weights and scales. Variants without bit 1 (the staged schedule).
const char* expert_gemm_mx(const ExpertGemmArgs& args);
const char* expert_gemm_swiglu(const ExpertGemmArgs& args);

}  // namespace megamoe
