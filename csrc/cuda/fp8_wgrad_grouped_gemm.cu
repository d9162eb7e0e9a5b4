// FP8 weight-gradient grouped GEMM variants (grouped_gemm.h, depth-grouped): each expert's
// D[g] = A_t[:, rows of g] @ B_t[:, rows of g]^T with 1x128 scales on both operands.
//
// These GEMMs are output-heavy: an expert's K is its 256-4096 pool rows, so a 128x128 tile
// writes 32 KB of bf16 after only 2-32 K steps, and at S1 the whole output (G*M*N*2 = 2.1 GB)
// takes ~0.45 ms of HBM time next to ~0.6 ms of fp8 tensor time. What matters is
// keeping the tensor cores busy while tiles are written out.
#include "grouped_gemm_impl.cuh"

namespace megamoe {
namespace {

using namespace cute;
using detail::GroupedDim;
using detail::GroupedGemm;
using E4M3 = cutlass::float_e4m3_t;
using NK = cutlass::layout::ColumnMajor;
using Cooperative = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using CooperativeEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
using PingpongEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

// 0: the forward's best: 128x128x128 tiles, both consumer warpgroups on one tile, a 1x2 cluster
//    sharing each A tile between neighbouring N tiles (TMA multicast). Its tensor cores idle
//    while the two warpgroups convert and store a finished tile.
// 1: ping-pong 64x128x128, 1x2 cluster: each consumer warpgroup owns a tile and they take turns,
//    so one warpgroup's epilogue runs under the other's MMAs. Larger per-warpgroup tiles do not
//    fit: the blockwise main loop keeps two fp32 accumulators (the running sum and the current
//    K step's), 2 x 64 registers per thread at 64x128, 2 x 128 at 128x128 (past 255).
// 2: 128x128x128 cooperative without a cluster, the control for the multicast.
using V0 = GroupedGemm<E4M3, NK, Shape<_128, _128, _128>, Shape<_1, _2, _1>, Cooperative, CooperativeEpi, GroupedDim::kDepth>;
using V1 = GroupedGemm<E4M3, NK, Shape<_64, _128, _128>, Shape<_1, _2, _1>, Pingpong, PingpongEpi, GroupedDim::kDepth>;
using V2 = GroupedGemm<E4M3, NK, Shape<_128, _128, _128>, Shape<_1, _1, _1>, Cooperative, CooperativeEpi, GroupedDim::kDepth>;

}  // namespace

int fp8_wgrad_grouped_gemm_variants() { return 3; }

size_t fp8_wgrad_grouped_gemm_workspace_bytes(int num_groups, int variant, int device) {
  switch (variant) {
    case 1: return V1::workspace_bytes(num_groups, device);
    case 2: return V2::workspace_bytes(num_groups, device);
    default: return V0::workspace_bytes(num_groups, device);
  }
}

const char* fp8_wgrad_grouped_gemm(const GroupedGemmArgs& args) {
  if (args.b_layout != BLayout::kNK) return "fp8 wgrad B must be [N, P] (pool rows contiguous)";
  switch (args.variant) {
    case 0: return V0::run(args);
    case 1: return V1::run(args);
    case 2: return V2::run(args);
    default: return "unknown fp8 wgrad variant";
  }
}

}  // namespace megamoe
