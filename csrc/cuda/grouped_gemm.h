// Grouped GEMMs over the expert-major pool, on Hopper (sm_90a), built from CUTLASS collectives.
//
// The pool holds each local expert's rows contiguously: group g owns rows
// [group_ends[g-1], group_ends[g]) (group_ends[-1] = 0) of A and D, and multiplies them by
// B[g]. group_ends lives on the device and is read there, so a call never waits for the host
// and can be captured in a CUDA graph. Rows past group_ends[G-1] are left untouched.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megamoe {

// How B[g] is stored: [N, K] with K contiguous (a weight read as in x @ W^T), or [K, N] with
// N contiguous (the same weight read untransposed, as in the backward's dY @ W).
enum class BLayout : int { kNK = 0, kKN = 1 };

// All pointers are device addresses; stream is a cudaStream_t.
struct GroupedGemmArgs {
  const void* a;              // [M_total, K] row-major (e4m3 or bf16)
  const float* a_scales;      // fp8 only: fp32 [M_total, K/128], one per row per 128-deep K block
  const void* b;              // [G, N, K] or [G, K, N] (see BLayout)
  const float* b_scales;      // fp8 only: fp32 [G, N/128, K/128], one per 128x128 block
  void* d;                    // bf16 [M_total, N] row-major
  const int32_t* group_ends;  // int32 [G], cumulative row ends
  int num_groups;
  int n;
  int k;
  BLayout b_layout;
  int variant;                // tile/cluster configuration (see grouped_gemm_variants())
  int swizzle;                // tile scheduler swizzle (1, 2, 4, 8)
  void* workspace;            // device scratch of grouped_gemm_workspace_bytes()
  size_t workspace_bytes;
  void* stream;
  int device;
};

// Scratch a call needs: per-group argument arrays plus CUTLASS's own workspace.
size_t fp8_grouped_gemm_workspace_bytes(int num_groups, int variant, int device);
size_t bf16_grouped_gemm_workspace_bytes(int num_groups, int variant, BLayout b_layout, int device);

// fp8: D[rows of g] = (A[rows] * a_scales) @ (B[g] * b_scales)^T, 1x128 / 128x128 block scales
// applied per 128-deep K step in fp32 (DeepSeek-V3's recipe); B is [N, K] (kNK) only.
// bf16: D[rows of g] = A[rows] @ B[g]^T, fp32 accumulation.
// Both return an empty string on success, else what went wrong.
const char* fp8_grouped_gemm(const GroupedGemmArgs& args);
const char* bf16_grouped_gemm(const GroupedGemmArgs& args);

// Number of compiled variants of each (index 0 is the default).
int fp8_grouped_gemm_variants();
int bf16_grouped_gemm_variants();

}  // namespace megamoe
