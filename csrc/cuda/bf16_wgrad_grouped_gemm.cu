// bf16 weight-gradient grouped GEMM accumulated into fp32 (grouped_gemm.h, depth-grouped):
// D[g] += A[rows of g]^T @ B[rows of g] with A = the pool's output gradients [P, M] and B = the
// pool's inputs [P, N], both read by TMA as stored (16-bit wgmma takes M- or N-major tiles), and
// D[g] an fp32 [M, N] gradient accumulator such as Megatron's main_grad.
//
// Folding the accumulation into the epilogue replaces a bf16 gradient write (2 bytes per
// weight) plus a separate main_grad += grad pass (2 + 4 + 4 bytes) by the epilogue's fp32 read
// and write (8 bytes), and keeps the product unrounded (NOTES.md).
#include "grouped_gemm_impl.cuh"

namespace megamoe {
namespace {

using namespace cute;
using detail::GroupedDim;
using detail::GroupedGemm;
using BF16 = cutlass::bfloat16_t;
using MK = cutlass::layout::ColumnMajor;  // A [M, K] with M contiguous: the pool [P, M] itself
using KN = cutlass::layout::RowMajor;     // B as [K, N] with N contiguous: the pool [P, N] itself
using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using Epi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

// 0: 128x128x64, 1x2 cluster (A tile multicast to neighbouring N tiles);
// 1: 128x256x64, no cluster: half the tiles, twice the fp32 epilogue per tile.
using V0 = GroupedGemm<BF16, KN, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Schedule, Epi, GroupedDim::kDepth, MK, float>;
using V1 = GroupedGemm<BF16, KN, Shape<_128, _256, _64>, Shape<_1, _1, _1>, Schedule, Epi, GroupedDim::kDepth, MK, float>;

}  // namespace

int bf16_wgrad_grouped_gemm_variants() { return 2; }

size_t bf16_wgrad_grouped_gemm_workspace_bytes(int num_groups, int variant, int device) {
  return variant == 1 ? V1::workspace_bytes(num_groups, device) : V0::workspace_bytes(num_groups, device);
}

const char* bf16_wgrad_grouped_gemm_accumulate(const GroupedGemmArgs& args) {
  switch (args.variant) {
    case 0: return V0::run(args);
    case 1: return V1::run(args);
    default: return "unknown bf16 wgrad variant";
  }
}

}  // namespace megamoe
