// bf16 weight-gradient grouped GEMMs (grouped_gemm.h, depth-grouped): D[g] = A[rows of g]^T @
// B[rows of g] with A = the pool's output gradients [P, M] and B = the pool's inputs [P, N], both
// read by TMA as stored (16-bit wgmma takes M- or N-major tiles). Three outputs:
// - stored: D[g] bf16 [M, N] (fp32 accumulation, rounded once);
// - accumulated: D[g] fp32 [M, N] += the product, e.g. Megatron's main_grad. Folding the
//   accumulation into the epilogue replaces a bf16 gradient write (2 bytes per weight) plus a
//   separate main_grad += grad pass (2 + 4 + 4 bytes) by the epilogue's fp32 read and write
//   (8 bytes), and keeps the product unrounded;
// - stored fp32: D[g] fp32 [M, N] = the product, for a main_grad whose contents are stale (the
//   step's first micro-batch when the grad buffer is not zeroed): 4 bytes per weight, and the
//   buffer's zeroing pass (another 4) is not needed.
//
// An expert's K is only its few hundred pool rows, so a tile finishes after a handful of K steps
// and its epilogue (convert, stage, store) is a large share of its time. The ping-pong variants
// give each consumer warpgroup its own tile and let them take turns, so one tile's epilogue runs
// under the other's MMAs; the cooperative ones put both warpgroups on one tile and the tensor
// cores wait while it is written.
#include "grouped_gemm_impl.cuh"

namespace megamoe {
namespace {

using namespace cute;
using detail::EpilogueBuffers;
using detail::GroupedDim;
using detail::GroupedGemm;
using BF16 = cutlass::bfloat16_t;
using MK = cutlass::layout::ColumnMajor;  // A [M, K] with M contiguous: the pool [P, M] itself
using KN = cutlass::layout::RowMajor;     // B as [K, N] with N contiguous: the pool [P, N] itself
using Cooperative = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using CooperativeEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using PingpongEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
using EpiAuto = cutlass::epilogue::collective::EpilogueTileAuto;

// The same configurations for every output (ElementD bf16 or float; kAcc: D += the product):
// 0: cooperative 128x128x64, 1x2 cluster (A tile multicast to neighbouring N tiles);
// 1: cooperative 128x256x64, no cluster: half the tiles, twice the epilogue per tile;
// 2: ping-pong 128x128x64 per warpgroup, 1x2 cluster.
// 3-5 are 0 and 2 with EpilogueBuffers (grouped_gemm_impl.cuh): C and D in buffers of their own.
// With the builder's buffers an fp32 D reuses C's four 128x32 buffers, so the next tile's C is
// fetched only as this tile's stores leave shared memory, the last subtile's during the next
// epilogue (its load latency exposed every tile); with 2 D buffers the epilogue waits, after each
// subtile's store, for the one before to leave shared memory. Shared memory per CTA (227 KB): the
// main loop keeps what the epilogue leaves, 32 KB a stage (static_assert in GroupedGemm).
// 3: 0 with 128x32 subtiles, C 4 buffers (a whole tile: the next tile's C is read while this one
//    is written), D 2 (fp32; 96 KB, 4 main-loop stages) or 4 (bf16: a tile's stores in flight);
// 4: 0 with 128x64 subtiles (half the subtile barriers and store waits), C 2 and D 2 buffers: a
//    whole tile of each (fp32 128 KB, 3 main-loop stages; bf16 32 KB);
// 5: 2 with 64x32 subtiles, C 8 buffers (a whole tile of the next warpgroup's C, read during its
//    main loop), D 4 (fp32; 96 KB, 4 main-loop stages) or 8 (bf16: a tile's stores in flight;
//    ping-pong still drains them at each tile's end, under the other warpgroup's MMAs).
template <class ElementD, bool kAcc>
using V0 = GroupedGemm<BF16, KN, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Cooperative, CooperativeEpi, GroupedDim::kDepth,
                       MK, ElementD, EpiAuto, kAcc>;
template <class ElementD, bool kAcc>
using V1 = GroupedGemm<BF16, KN, Shape<_128, _256, _64>, Shape<_1, _1, _1>, Cooperative, CooperativeEpi, GroupedDim::kDepth,
                       MK, ElementD, EpiAuto, kAcc>;
template <class ElementD, bool kAcc>
using V2 = GroupedGemm<BF16, KN, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Pingpong, PingpongEpi, GroupedDim::kDepth, MK,
                       ElementD, EpiAuto, kAcc>;
template <class ElementD>
constexpr bool kFp32 = std::is_same_v<ElementD, float>;
template <class ElementD, bool kAcc>
using V3 = GroupedGemm<BF16, KN, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Cooperative, CooperativeEpi, GroupedDim::kDepth,
                       MK, ElementD, EpilogueBuffers<Shape<_128, _32>, 4, kFp32<ElementD> ? 2 : 4>, kAcc>;
template <class ElementD, bool kAcc>
using V4 = GroupedGemm<BF16, KN, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Cooperative, CooperativeEpi, GroupedDim::kDepth,
                       MK, ElementD, EpilogueBuffers<Shape<_128, _64>, 2, 2>, kAcc>;
template <class ElementD, bool kAcc>
using V5 = GroupedGemm<BF16, KN, Shape<_128, _128, _64>, Shape<_1, _2, _1>, Pingpong, PingpongEpi, GroupedDim::kDepth, MK,
                       ElementD, EpilogueBuffers<Shape<_64, _32>, 8, kFp32<ElementD> ? 4 : 8>, kAcc>;

template <class ElementD, bool kAcc>
size_t workspace_bytes(int num_groups, int variant, int device) {
  switch (variant) {
    case 1: return V1<ElementD, kAcc>::workspace_bytes(num_groups, device);
    case 2: return V2<ElementD, kAcc>::workspace_bytes(num_groups, device);
    case 3: return V3<ElementD, kAcc>::workspace_bytes(num_groups, device);
    case 4: return V4<ElementD, kAcc>::workspace_bytes(num_groups, device);
    case 5: return V5<ElementD, kAcc>::workspace_bytes(num_groups, device);
    default: return V0<ElementD, kAcc>::workspace_bytes(num_groups, device);
  }
}

template <class ElementD, bool kAcc>
const char* run(const GroupedGemmArgs& args) {
  switch (args.variant) {
    case 0: return V0<ElementD, kAcc>::run(args);
    case 1: return V1<ElementD, kAcc>::run(args);
    case 2: return V2<ElementD, kAcc>::run(args);
    case 3: return V3<ElementD, kAcc>::run(args);
    case 4: return V4<ElementD, kAcc>::run(args);
    case 5: return V5<ElementD, kAcc>::run(args);
    default: return "unknown bf16 wgrad variant";
  }
}

}  // namespace

int bf16_wgrad_grouped_gemm_variants() { return 6; }

size_t bf16_wgrad_grouped_gemm_workspace_bytes(int num_groups, int variant, Bf16WgradOutput output, int device) {
  switch (output) {
    case Bf16WgradOutput::kStoreFp32: return workspace_bytes<float, false>(num_groups, variant, device);
    case Bf16WgradOutput::kAccumulateFp32: return workspace_bytes<float, true>(num_groups, variant, device);
    default: return workspace_bytes<BF16, false>(num_groups, variant, device);
  }
}

const char* bf16_wgrad_grouped_gemm(const GroupedGemmArgs& args, Bf16WgradOutput output) {
  switch (output) {
    case Bf16WgradOutput::kStoreBf16: return run<BF16, false>(args);
    case Bf16WgradOutput::kStoreFp32: return run<float, false>(args);
    case Bf16WgradOutput::kAccumulateFp32: return run<float, true>(args);
    default: return "unknown bf16 wgrad output";
  }
}

}  // namespace megamoe
