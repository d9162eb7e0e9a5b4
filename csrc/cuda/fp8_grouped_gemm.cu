// FP8 block-scaled grouped GEMM variants (grouped_gemm.h). 128x128 output tiles, 128 deep: one
// scale block per K step, applied to each partial product before it is accumulated.
#include "grouped_gemm_impl.cuh"

namespace megamoe {
namespace {

using namespace cute;
using detail::GroupedGemm;
using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using Epi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using E4M3 = cutlass::float_e4m3_t;
using NK = cutlass::layout::ColumnMajor;

// 0: a 1x2 cluster shares each A tile between the CTAs of neighbouring N tiles (TMA multicast);
// 1: a 2x1 cluster shares each B tile between neighbouring M tiles; 2: no cluster.
// Ping-pong 64x128 tiles (1x2 and 2x1 clusters) measured 25-50% slower than 0 at S1-S4
// (2026-11-30), and 6-23% slower at the training proxy's GEMMs, K = 512 included, on the
// layer's pool sizes; 64x256 does not compile (one B scale per N tile): not kept.
using V0 = GroupedGemm<E4M3, NK, Shape<_128, _128, _128>, Shape<_1, _2, _1>, Schedule, Epi>;
using V1 = GroupedGemm<E4M3, NK, Shape<_128, _128, _128>, Shape<_2, _1, _1>, Schedule, Epi>;
using V2 = GroupedGemm<E4M3, NK, Shape<_128, _128, _128>, Shape<_1, _1, _1>, Schedule, Epi>;

}  // namespace

int fp8_grouped_gemm_variants() { return 3; }

size_t fp8_grouped_gemm_workspace_bytes(int num_groups, int variant, int device) {
  switch (variant) {
    case 1: return V1::workspace_bytes(num_groups, device);
    case 2: return V2::workspace_bytes(num_groups, device);
    default: return V0::workspace_bytes(num_groups, device);
  }
}

const char* fp8_grouped_gemm(const GroupedGemmArgs& args) {
  if (args.b_layout != BLayout::kNK) return "fp8 B must be [N, K] (K contiguous): fp8 wgmma reads K-major operands";
  switch (args.variant) {
    case 0: return V0::run(args);
    case 1: return V1::run(args);
    case 2: return V2::run(args);
    default: return "unknown fp8 variant";
  }
}

}  // namespace megamoe
