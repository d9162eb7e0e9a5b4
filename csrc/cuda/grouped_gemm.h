// Grouped GEMMs over the expert-major pool, on Hopper (sm_90a), built from CUTLASS collectives.
//
// The pool holds each local expert's rows contiguously: group g owns pool rows
// [group_ends[g-1], group_ends[g]) (group_ends[-1] = 0). Two ways to multiply by them:
// - row-grouped (forward, dgrad): the rows are rows of A and D, D[rows] = A[rows] @ B[g]^T;
//   rows past group_ends[G-1] are left untouched;
// - depth-grouped (wgrad): the rows are the K of group g's product of two pool-transposed
//   operands, D[g] = A_t[:, rows] @ B_t[:, rows]^T (fp8), or of the pool operands themselves,
//   D[g] = A[rows]^T @ B[rows] (bf16; D bf16 stored, fp32 stored or fp32 accumulated into); pool rows past
//   group_ends[G-1] are not read.
// group_ends lives on the device and is read there, so a call never waits for the host and can
// be captured in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megamoe {

// How B[g] is stored: [N, K] with K contiguous (a weight read as in x @ W^T), or [K, N] with
// N contiguous (the same weight read untransposed, as in the backward's dY @ W).
enum class BLayout : int { kNK = 0, kKN = 1 };

// All pointers are device addresses; stream is a cudaStream_t. Shapes in brackets are
// row-grouped / depth-grouped (P = pool rows).
struct GroupedGemmArgs {
  const void* a;              // [M_total, K] / e4m3 [M, P] or bf16 [P, M], row-major
  const float* a_scales;      // fp8 only: fp32 [M_total, K/128] / [M, P/128], one per row per 128-deep K block
  const void* b;              // [G, N, K] or [G, K, N] (see BLayout) / e4m3 [N, P] or bf16 [P, N]
  const float* b_scales;      // fp8 only: fp32 [G, N/128, K/128], one per 128x128 block / [N, P/128] like A's
  void* d;                    // bf16 [M_total, N] / bf16 or fp32 (stored or accumulated into) [G, M, N], row-major
  const int32_t* group_ends;  // int32 [G], cumulative pool-row ends
  int num_groups;
  int m;                      // depth-grouped only: rows of each group's D
  int n;
  int k;                      // K / P
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
size_t fp8_wgrad_grouped_gemm_workspace_bytes(int num_groups, int variant, int device);
size_t bf16_grouped_gemm_workspace_bytes(int num_groups, int variant, BLayout b_layout, int device);
// What a bf16 wgrad writes into D: bf16 or fp32 values (the product, D's old contents never
// read), or fp32 values added to D's (D += the product).
enum class Bf16WgradOutput : int { kStoreBf16 = 0, kStoreFp32 = 1, kAccumulateFp32 = 2 };
size_t bf16_wgrad_grouped_gemm_workspace_bytes(int num_groups, int variant, Bf16WgradOutput output, int device);

// fp8: D[rows of g] = (A[rows] * a_scales) @ (B[g] * b_scales)^T, 1x128 / 128x128 block scales
// applied per 128-deep K step in fp32 (DeepSeek-V3's recipe); B is [N, K] (kNK) only.
// bf16: D[rows of g] = A[rows] @ B[g]^T, fp32 accumulation.
// fp8 wgrad (depth-grouped): D[g] = sum over pool rows k of group g of
// (A_t[:, k] * a_scales[:, k/128]) (B_t[:, k] * b_scales[:, k/128])^T, 1x128 scales on both
// operands applied per 128-deep K step in fp32. group_ends must be multiples of 128,
// nondecreasing and <= P; an empty group's D[g] is zero, and a group breaking those rules is
// not computed and its D[g] is NaN (the sizes live on the device: nothing is checked on the host).
// bf16 wgrad (depth-grouped): D[g] = A[rows of g]^T @ B[rows of g] with fp32 accumulation, A the
// pool [P, M] and B the pool [P, N] (bf16, as stored), D [G, M, N] bf16 or fp32 (see
// Bf16WgradOutput); stored, an empty group's D[g] is zero and one whose range is not inside
// [0, P] is not computed and gets NaN. Accumulating: D fp32 [G, M, N] += the product
// (unrounded); a group with no rows, or whose range is not inside [0, P], is not computed: its
// D[g] is left as it was.
// All return an empty string on success, else what went wrong.
const char* fp8_grouped_gemm(const GroupedGemmArgs& args);
const char* bf16_grouped_gemm(const GroupedGemmArgs& args);
const char* fp8_wgrad_grouped_gemm(const GroupedGemmArgs& args);
const char* bf16_wgrad_grouped_gemm(const GroupedGemmArgs& args, Bf16WgradOutput output);

// Number of compiled variants of each (index 0 is the default).
int fp8_grouped_gemm_variants();
int bf16_grouped_gemm_variants();
int fp8_wgrad_grouped_gemm_variants();
int bf16_wgrad_grouped_gemm_variants();

}  // namespace megamoe
