// Grouped GEMMs over the expert-major pool, on Hopper (sm_90a), built from CUTLASS collectives.
//
// The pool holds each local expert's rows contiguously: group g owns rows
// [group_ends[g-1], group_ends[g]) (group_ends[-1] = 0) of A and D, and multiplies them by
// B[g]. group_ends lives on the device and is read there, so a call never waits for the host
// and can be captured in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

namespace megamoe {

// All pointers are device addresses; stream is a cudaStream_t.
struct Fp8GroupedGemmArgs {
  const void* a;         // e4m3 [M_total, K], row-major
  const float* a_scales; // fp32 [M_total, K/128]: one scale per row per 128-deep K block
  const void* b;         // e4m3 [G, N, K], row-major (each expert's weight, K contiguous)
  const float* b_scales; // fp32 [G, N/128, K/128]: one scale per 128x128 block
  void* d;               // bf16 [M_total, N], row-major; rows past group_ends[G-1] untouched
  const int32_t* group_ends; // int32 [G], cumulative; every group size a multiple of 128
  int num_groups;
  int n;
  int k;
  void* workspace;       // device scratch of fp8_grouped_gemm_workspace_bytes(num_groups)
  size_t workspace_bytes;
  void* stream;
  int device;
};

// Scratch the call needs: per-group argument arrays plus CUTLASS's own workspace.
size_t fp8_grouped_gemm_workspace_bytes(int num_groups, int device);

// D[rows of g] = (A[rows of g] * a_scales) @ (B[g] * b_scales)^T, fp32 accumulation, bf16 out.
// Returns an empty string on success, else what went wrong.
const char* fp8_grouped_gemm(const Fp8GroupedGemmArgs& args);

}  // namespace megamoe
