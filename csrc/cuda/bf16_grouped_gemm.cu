// bf16 grouped GEMM variants (grouped_gemm.h): B[g] as [N, K] for the forward (x @ W^T) and as
// [K, N] for the backward's dgrad (dY @ W), both read by TMA without a transposed copy.
#include "grouped_gemm_impl.cuh"

namespace megamoe {
namespace {

using namespace cute;
using detail::GroupedGemm;
using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using Epi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using BF16 = cutlass::bfloat16_t;
using NK = cutlass::layout::ColumnMajor;
using KN = cutlass::layout::RowMajor;

// 0: 128x256x64 tiles, 2x1 cluster (B tile multicast to neighbouring M tiles);
// 1: 128x128x64 tiles, 1x2 cluster;
// 2: 128x256x64 tiles, 1x2 cluster (A tile multicast to neighbouring N tiles). A 2x1 cluster
//    pairs an expert's M tiles, so an expert with an odd number of 128-row tiles (S1: 3) leaves
//    one CTA of a pair idle; pairing N tiles (N / 256 is even at every layer shape) does not.
// Ping-pong 64x256x64 and 64x128x64 (1x2) measured 1.4-2x slower at S1-S4
// (2026-11-30): not kept.
using NK0 = GroupedGemm<BF16, NK, Shape<_128, _256, _64>, Shape<_2, _1, _1>, Schedule, Epi>;
using NK1 = GroupedGemm<BF16, NK, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Schedule, Epi>;
using NK2 = GroupedGemm<BF16, NK, Shape<_128, _256, _64>, Shape<_1, _2, _1>, Schedule, Epi>;
using KN0 = GroupedGemm<BF16, KN, Shape<_128, _256, _64>, Shape<_2, _1, _1>, Schedule, Epi>;
using KN1 = GroupedGemm<BF16, KN, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Schedule, Epi>;
using KN2 = GroupedGemm<BF16, KN, Shape<_128, _256, _64>, Shape<_1, _2, _1>, Schedule, Epi>;

}  // namespace

int bf16_grouped_gemm_variants() { return 3; }

size_t bf16_grouped_gemm_workspace_bytes(int num_groups, int variant, BLayout b_layout, int device) {
  bool nk = b_layout == BLayout::kNK;
  switch (variant) {
    case 1: return nk ? NK1::workspace_bytes(num_groups, device) : KN1::workspace_bytes(num_groups, device);
    case 2: return nk ? NK2::workspace_bytes(num_groups, device) : KN2::workspace_bytes(num_groups, device);
    default: return nk ? NK0::workspace_bytes(num_groups, device) : KN0::workspace_bytes(num_groups, device);
  }
}

const char* bf16_grouped_gemm(const GroupedGemmArgs& args) {
  bool nk = args.b_layout == BLayout::kNK;
  switch (args.variant) {
    case 0: return nk ? NK0::run(args) : KN0::run(args);
    case 1: return nk ? NK1::run(args) : KN1::run(args);
    case 2: return nk ? NK2::run(args) : KN2::run(args);
    default: return "unknown bf16 variant";
  }
}

}  // namespace megamoe
