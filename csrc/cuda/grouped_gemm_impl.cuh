// The grouped GEMM of grouped_gemm.h as one template over element type, B layout and tile
// configuration, on CUTLASS's Hopper pointer-array collectives: TMA loads, warp-specialized
// producer/consumer warpgroups, a persistent grid over every group's tiles.
//
// Group sizes are known only on the device (the routing plan is built there), so one small
// kernel turns group_ends into CUTLASS's per-group argument arrays and the GEMM reads them:
// no host sync, capturable in a CUDA graph. The groups split M (row-grouped: forward, dgrad) or
// K (depth-grouped: the wgrad, grouped_gemm.h).
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "grouped_gemm.h"

namespace megamoe {
namespace detail {

using namespace cute;

constexpr int kScaleBlock = 128;  // the fp8 recipe's scale block along K (and along N for B)
constexpr size_t kAlign = 256;

inline size_t round_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Restores the caller's current device on exit (the CUDA runtime is linked statically, so its
// current device is ours to set: torch's setting lives in torch's runtime).
struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous);
    if (previous != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (previous >= 0 && now != previous) cudaSetDevice(previous);
  }
};

// Which problem dimension the pool's groups split (grouped_gemm.h).
enum class GroupedDim { kRows, kDepth };

// CUTLASS 4.2's pointer-array blockwise main loop takes per-group scale layouts but, for a
// grouped GEMM, rebuilds them on the device from the group's (M, N, K) as if the scales were
// packed (row stride K/128). Depth-grouped scales are [rows, P/128] and a group's K is only its
// share of P, so this main loop reads the layouts it is given instead: everything else is the
// base collective's.
template <class Base>
struct StridedScalesMainloop : Base {
  template <class InputTensors, class ProblemShapeMNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& inputs, typename Base::Params const& params,
                                                     ProblemShapeMNKL problem_shape_mnkl, int32_t group) {
    InputTensors out = Base::tensors_perform_update(inputs, params, problem_shape_mnkl, group);
    get<2>(out) = make_tensor(make_gmem_ptr(params.ptr_SFA[group]), params.layout_SFA[group]);
    get<3>(out) = make_tensor(make_gmem_ptr(params.ptr_SFB[group]), params.layout_SFB[group]);
    return out;
  }
};

// The epilogue's subtile and shared-memory buffers, GroupedGemm's last parameter. Through CUTLASS's
// epilogue builder: EpilogueTileAuto (the default: 128x32 subtiles for a cooperative tile, 64x32
// for a ping-pong one) or an explicit subtile (a cute::Shape), both with the builder's buffers
// (sm90_get_tma_dispatch_policy): D 2 stages and C min(subtiles, 4), C's buffer reused by D when
// C and D have one width (fp32 accumulation), so a C buffer is refilled only after the store that
// reused it has left shared memory. EpilogueBuffers instead gives C and D buffers of their own,
// StagesC and StagesD subtiles: the C producer refills a buffer as soon as the epilogue has read
// it (StagesC = a tile's subtiles: the next tile's C is fetched during this tile's epilogue),
// and up to StagesD stores are in flight before the epilogue waits for one to leave. The main
// loop gets whatever shared memory is left (StageCountAutoCarveout).
template <class EpilogueTile_, int StagesC_, int StagesD_>
struct EpilogueBuffers {
  using EpilogueTile = EpilogueTile_;
  static constexpr int kStagesC = StagesC_;
  static constexpr int kStagesD = StagesD_;
};

template <class Config, class TileShape, class ClusterShape, class ElementC, class ElementD, class LayoutD, int kAlignD,
          class EpilogueSchedule>
struct EpilogueFor {  // EpilogueTileAuto or an explicit subtile: the builder's policy
  using type = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, Config, float, float,
      ElementC, LayoutD*, kAlignD,  // no source operand (beta = 0) unless accumulating into D
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC>>::CollectiveOp;
};

template <class EpilogueTile, int kStagesC, int kStagesD, class TileShape, class ClusterShape, class ElementC,
          class ElementD, class LayoutD, int kAlignD, class EpilogueSchedule>
struct EpilogueFor<EpilogueBuffers<EpilogueTile, kStagesC, kStagesD>, TileShape, ClusterShape, ElementC, ElementD, LayoutD,
                   kAlignD, EpilogueSchedule> {
  static_assert(cutlass::epilogue::collective::detail::sm90_is_ptr_array_tma_v<EpilogueSchedule>,
                "EpilogueBuffers builds the pointer-array TMA epilogue");
  // the builder's own check of an explicit subtile (M = 128 cooperative, 64 ping-pong; N % 16 == 0)
  using Tile = decltype(cutlass::epilogue::collective::detail::sm90_compute_tile_shape_or_override<
                        ElementD, EpilogueTile, EpilogueSchedule, TileShape>());
  static constexpr bool kCooperative = cutlass::epilogue::collective::detail::sm90_is_cooperative_v<EpilogueSchedule>;
  static constexpr int kSubtiles = size(shape_div(take<0, 2>(TileShape{}), Tile{}));
  static_assert(kStagesC >= 1 && kStagesD >= 1 && kStagesD <= kSubtiles, "stages of a subtile each, D at most a tile");
  // the builder's policy with ReuseSmemC = false; DelayTmaStore is off for pointer-array epilogues
  using Policy = cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<
      kStagesC, kStagesD, static_cast<int>(size(Tile{})) / (kCooperative ? 256 : 128), /*ReuseSmemC=*/false,
      /*DelayTmaStore=*/false, EpilogueSchedule::NumEpilogueWarpGroups>;
  using type = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
      TileShape, Tile, float, float, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC>, Policy>::CollectiveOp;
};

// ElementAB: cutlass::float_e4m3_t (block-scaled) or cutlass::bfloat16_t.
// LayoutB: ColumnMajor = B[g] stored [N, K] (K contiguous); RowMajor = stored [K, N].
// Depth-grouped, two kinds:
// - fp8: both operands K-major (what fp8 wgmma reads), pool-transposed, 1x128 scales on both;
//   bf16 D[g] is written;
// - bf16: both operands the pool itself ([P, M] and [P, N], M and N contiguous: LayoutA
//   ColumnMajor, LayoutB RowMajor; 16-bit wgmma reads either major); D[g] is written (bf16, or
//   fp32 for ElementD float), or with kAccumulate (ElementD float) D[g] fp32 is accumulated into
//   (D += A^T B: C is D, beta = 1), e.g. a parameter's fp32 main_grad. Writing fp32 is for a
//   main_grad whose old contents are stale (the first micro-batch of a step): no read of D.
// EpilogueConfig: EpilogueTileAuto, a subtile shape or EpilogueBuffers (above).
template <class ElementAB, class LayoutB_, class TileShape_, class ClusterShape_, class Schedule, class EpilogueSchedule,
          GroupedDim kGroupedDim = GroupedDim::kRows, class LayoutA_ = cutlass::layout::RowMajor,
          class ElementD_ = cutlass::bfloat16_t, class EpilogueConfig = cutlass::epilogue::collective::EpilogueTileAuto,
          bool kAccumulate_ = false>
struct GroupedGemm {
  using Element = ElementAB;
  static constexpr bool kBlockScaled = std::is_same_v<ElementAB, cutlass::float_e4m3_t>;
  static constexpr bool kDepthGrouped = kGroupedDim == GroupedDim::kDepth;
  static constexpr bool kAccumulate = kAccumulate_;  // D += A @ B (C = D, beta = 1)
  static_assert(!kAccumulate || std::is_same_v<ElementD_, float>, "accumulation is into fp32");
  static_assert(!kDepthGrouped || (kBlockScaled && std::is_same_v<LayoutB_, cutlass::layout::ColumnMajor> &&
                                   std::is_same_v<LayoutA_, cutlass::layout::RowMajor> && !kAccumulate) ||
                    (!kBlockScaled && std::is_same_v<LayoutB_, cutlass::layout::RowMajor> &&
                     std::is_same_v<LayoutA_, cutlass::layout::ColumnMajor>),
                "depth-grouped GEMMs: fp8 with both operands K-major, or bf16 pool operands (stored or accumulated)");
  static_assert(kDepthGrouped || (std::is_same_v<LayoutA_, cutlass::layout::RowMajor> && !kAccumulate),
                "row-grouped GEMMs read A row-major and write bf16");
  static constexpr int kAlignAB = 16 / sizeof(ElementAB);
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
  using ElementD = ElementD_;
  using ElementC = std::conditional_t<kAccumulate, float, void>;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using LayoutA = LayoutA_;
  using LayoutB = LayoutB_;
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;

  // Scales are K-major, as the protocol stores them: a_scales [M, K/128], b_scales [N/128, K/128]
  // for a weight B (one per 128x128 block), [N, K/128] for a pool-transposed B (one per row).
  static constexpr int kScaleBlockN = kDepthGrouped ? 1 : kScaleBlock;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlockN, kScaleBlock, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using StridePairA = std::conditional_t<kBlockScaled, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using StridePairB = std::conditional_t<kBlockScaled, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;

  using Epilogue =
      typename EpilogueFor<EpilogueConfig, TileShape, ClusterShape, ElementC, ElementD, LayoutD, kAlignD, EpilogueSchedule>::type;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementAB, StridePairA, kAlignAB,
      ElementAB, StridePairB, kAlignAB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Mainloop = std::conditional_t<kDepthGrouped && kBlockScaled, StridedScalesMainloop<BuiltMainloop>, BuiltMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  static_assert(Kernel::SharedStorageSize <= cutlass::gemm::collective::detail::sm90_smem_capacity_bytes,
                "the kernel's shared memory exceeds an SM's 227 KB");
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using GroupShape = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // CUTLASS's per-group argument arrays, carved out of the caller's workspace.
  struct GroupArrays {
    GroupShape* shapes;
    const ElementAB** a;
    const ElementAB** b;
    ElementD** d;
    const float** sfa;
    const float** sfb;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
    void* gemm_workspace;
  };

  static GroupArrays carve(void* workspace, int g, size_t* used = nullptr) {
    char* base = static_cast<char*>(workspace);
    size_t offset = 0;
    auto take = [&](size_t bytes) {
      void* out = base + offset;
      offset += round_up(bytes);
      return out;
    };
    GroupArrays arr;
    arr.shapes = static_cast<GroupShape*>(take(sizeof(GroupShape) * g));
    arr.a = static_cast<const ElementAB**>(take(sizeof(void*) * g));
    arr.b = static_cast<const ElementAB**>(take(sizeof(void*) * g));
    arr.d = static_cast<ElementD**>(take(sizeof(void*) * g));
    arr.sfa = static_cast<const float**>(take(sizeof(void*) * g));
    arr.sfb = static_cast<const float**>(take(sizeof(void*) * g));
    arr.stride_a = static_cast<StrideA*>(take(sizeof(StrideA) * g));
    arr.stride_b = static_cast<StrideB*>(take(sizeof(StrideB) * g));
    arr.stride_d = static_cast<StrideD*>(take(sizeof(StrideD) * g));
    arr.layout_sfa = static_cast<LayoutSFA*>(take(sizeof(LayoutSFA) * g));
    arr.layout_sfb = static_cast<LayoutSFB*>(take(sizeof(LayoutSFB) * g));
    arr.gemm_workspace = base + offset;
    if (used) *used = offset;
    return arr;
  }

  // The SM count and the clusters that fit at once, read once per device (the occupancy query
  // is a host call that costs far more than a launch).
  static cutlass::KernelHardwareInfo hardware_info(int device) {
    static std::mutex mutex;
    static std::unordered_map<int, cutlass::KernelHardwareInfo> cache;
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(device);
    if (it == cache.end()) {
      it = cache.emplace(device, cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device)).first;
    }
    return it->second;
  }

  static typename Gemm::Arguments arguments(const GroupArrays& arr, int num_groups, int device, int swizzle) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {num_groups, arr.shapes, nullptr};  // no host shapes: sizes are read on the device
    if constexpr (kBlockScaled) {
      args.mainloop = {arr.a, arr.stride_a, arr.b, arr.stride_b, arr.sfa, arr.layout_sfa, arr.sfb, arr.layout_sfb};
    } else {
      args.mainloop = {arr.a, arr.stride_a, arr.b, arr.stride_b};
    }
    if constexpr (kAccumulate) {
      args.epilogue = {{}, const_cast<const ElementD**>(arr.d), arr.stride_d, arr.d, arr.stride_d};
    } else {
      args.epilogue = {{}, nullptr, arr.stride_d, arr.d, arr.stride_d};
    }
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = kAccumulate ? 1.0f : 0.0f;
    args.hw_info = hardware_info(device);
    args.scheduler.max_swizzle_size = swizzle;
    return args;
  }

  static size_t workspace_bytes(int num_groups, int device) {
    DeviceGuard guard(device);
    size_t arrays = 0;
    GroupArrays arr = carve(nullptr, num_groups, &arrays);
    return arrays + round_up(Gemm::get_workspace_size(arguments(arr, num_groups, device, 1)));
  }

  static const char* run(const GroupedGemmArgs& p);
};

// The device functions below are also host functions so that tests/csrc/group_arrays_check.cu
// can check the arrays on a machine without a GPU.

// A depth-grouped group's pool rows [start, end) are usable as its K when they are whole scale
// blocks inside the pool (p rows); both kernels below decide it with this one function.
CUTE_HOST_DEVICE bool depth_range_valid(int64_t start, int64_t end, int64_t p) {
  return start >= 0 && start <= end && end <= p && start % kScaleBlock == 0 && end % kScaleBlock == 0;
}

CUTE_HOST_DEVICE int64_t group_start(const int32_t* group_ends, int g) { return g == 0 ? 0 : group_ends[g - 1]; }

// Whether a depth-grouped GEMM can use pool rows [start, end) as a group's K: fp8 needs whole
// scale blocks, bf16 only a range inside the pool.
template <class G>
CUTE_HOST_DEVICE bool depth_range_usable(int64_t start, int64_t end, int64_t p) {
  if constexpr (G::kBlockScaled) {
    return depth_range_valid(start, end, p);
  } else {
    return start >= 0 && start <= end && end <= p;
  }
}

// Group g's entries of the argument arrays: its row range from group_ends, then every pointer,
// stride and layout CUTLASS reads for it. 64-bit offsets throughout (pools past 2^31 elements).
// Row-grouped: rows [start, end) of A and D times B[g] ([N, K] or [K, N]), problem (rows, n, k).
// Depth-grouped: columns [start, end) of A_t [m, k] and B_t [n, k] (k = P pool rows, both with
// leading dimension P and scales with leading dimension P/128) into D[g], problem (m, n, rows).
// A group with no rows (or a bad range) gets M = 0, so no tiles: the main loop cannot run zero K
// steps, and fill_skipped_groups writes its output.
template <class G>
CUTE_HOST_DEVICE void fill_group_entry(typename G::GroupArrays const& arr, const int32_t* group_ends, int g, int m,
                                       int n, int k, const void* a, const float* sfa, const void* b, const float* sfb,
                                       void* d) {
  using ElementAB = typename G::Element;
  int64_t start = group_start(group_ends, g);
  int64_t end = group_ends[g];
  int64_t kb = k / kScaleBlock;
  typename G::StrideA sa{};
  if constexpr (std::is_same_v<typename G::LayoutA, cutlass::layout::RowMajor>) {
    get<0>(sa) = k;  // A rows of K (depth-grouped fp8: of P)
  } else {
    get<1>(sa) = m;  // depth-grouped bf16: A^T is the pool [P, M], M elements per k
  }
  typename G::StrideB sb{};
  if constexpr (std::is_same_v<typename G::LayoutB, cutlass::layout::ColumnMajor>) {
    get<0>(sb) = k;  // B as [N, K]: step K elements per n
  } else {
    get<1>(sb) = n;  // B[g] as [K, N] (depth-grouped bf16: the pool [P, N]): step N elements per k
  }
  typename G::StrideD sd{};
  get<0>(sd) = n;
  arr.stride_a[g] = sa;
  arr.stride_b[g] = sb;
  arr.stride_d[g] = sd;
  if constexpr (G::kDepthGrouped && !G::kBlockScaled) {
    // a group with no rows (or a bad range) gets no tiles: accumulating, it adds nothing; storing,
    // fill_skipped_groups writes its D[g]
    bool live = start < end && depth_range_usable<G>(start, end, k);
    int64_t offset = live ? start : 0;
    arr.shapes[g] = typename G::GroupShape(live ? m : 0, n, live ? static_cast<int>(end - start) : 0);
    arr.a[g] = static_cast<const ElementAB*>(a) + offset * m;
    arr.b[g] = static_cast<const ElementAB*>(b) + offset * n;
    arr.d[g] = static_cast<typename G::ElementD*>(d) + static_cast<int64_t>(g) * m * n;
  } else if constexpr (G::kDepthGrouped) {
    bool live = start < end && depth_range_usable<G>(start, end, k);
    int depth = live ? static_cast<int>(end - start) : 0;
    arr.shapes[g] = typename G::GroupShape(live ? m : 0, n, depth);
    int64_t offset = live ? start : 0;  // a skipped group's pointers stay inside the operands
    arr.a[g] = static_cast<const ElementAB*>(a) + offset;
    arr.b[g] = static_cast<const ElementAB*>(b) + offset;
    arr.d[g] = static_cast<typename G::ElementD*>(d) + static_cast<int64_t>(g) * m * n;
    arr.sfa[g] = sfa + offset / kScaleBlock;
    arr.sfb[g] = sfb + offset / kScaleBlock;
    // the group's share of the scale columns, rows kb apart (not the packed depth / 128)
    auto packed_a = G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, depth, 1));
    auto packed_b = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, depth, 1));
    arr.layout_sfa[g] = typename G::LayoutSFA(
        packed_a.shape(), replace<0>(packed_a.stride(), replace<1>(get<0>(packed_a.stride()), static_cast<int32_t>(kb))));
    arr.layout_sfb[g] = typename G::LayoutSFB(
        packed_b.shape(), replace<0>(packed_b.stride(), replace<1>(get<0>(packed_b.stride()), static_cast<int32_t>(kb))));
  } else {
    int rows = static_cast<int>(end - start);
    arr.shapes[g] = typename G::GroupShape(rows, n, k);
    arr.a[g] = static_cast<const ElementAB*>(a) + start * k;
    arr.b[g] = static_cast<const ElementAB*>(b) + static_cast<int64_t>(g) * n * k;
    arr.d[g] = static_cast<typename G::ElementD*>(d) + start * n;
    if constexpr (G::kBlockScaled) {
      arr.sfa[g] = sfa + start * kb;
      arr.sfb[g] = sfb + static_cast<int64_t>(g) * (n / kScaleBlock) * kb;
      arr.layout_sfa[g] = G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, n, k, 1));
      arr.layout_sfb[g] = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, n, k, 1));
    }
  }
}

// One thread per group.
template <class G>
__global__ void fill_group_arrays(typename G::GroupArrays arr, const int32_t* group_ends, int num_groups, int m, int n,
                                  int k, const void* a, const float* sfa, const void* b, const float* sfb, void* d) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g < num_groups) fill_group_entry<G>(arr, group_ends, g, m, n, k, a, sfa, b, sfb, d);
}

// Depth-grouped, storing (bf16 or fp32): the output D[g] (m x n) of every group the GEMM gives no
// tiles. An expert that received no rows has a zero gradient; a bad range gets NaN, so it cannot
// pass for one. blockIdx.y is the group; the blocks of computed groups exit at once.
template <class G>
__global__ void fill_skipped_groups(const int32_t* group_ends, int64_t group_elems, int64_t p, void* d) {
  constexpr int kBytes = sizeof(typename G::ElementD);
  static_assert(kBytes == 2 || kBytes == 4, "bf16 or fp32 output");
  int g = blockIdx.y;
  int64_t start = group_start(group_ends, g);
  int64_t end = group_ends[g];
  bool usable = depth_range_usable<G>(start, end, p);
  bool empty = start == end && usable;
  if (start < end && usable) return;
  uint32_t word;  // zero or a quiet NaN, as many as fit in 32 bits
  if constexpr (kBytes == 2) {
    word = empty ? 0u : 0x7fc07fc0u;
  } else {
    word = empty ? 0u : 0x7fc00000u;
  }
  uint4 fill = make_uint4(word, word, word, word);
  uint4* out = reinterpret_cast<uint4*>(static_cast<char*>(d) + g * group_elems * kBytes);  // 16-byte aligned (checked)
  int64_t chunks = group_elems * kBytes / 16;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = fill;
  }
}

template <class ElementAB, class LayoutB, class TileShape, class ClusterShape, class Schedule, class EpilogueSchedule,
          GroupedDim kGroupedDim, class LayoutA, class ElementD, class EpilogueConfig, bool kAccumulate_>
const char* GroupedGemm<ElementAB, LayoutB, TileShape, ClusterShape, Schedule, EpilogueSchedule, kGroupedDim, LayoutA,
                        ElementD, EpilogueConfig, kAccumulate_>::run(
    const GroupedGemmArgs& p) {
  using Self = GroupedGemm;
  if (p.num_groups <= 0) return "num_groups must be positive";
  // row-grouped: every group's K is k, and the main loop cannot run zero K steps (depth-grouped
  // groups with no rows get no tiles instead)
  if (!kDepthGrouped && p.k <= 0) return "K must be positive";
  if (kBlockScaled && (p.n % kScaleBlock || p.k % kScaleBlock)) return "N and K must be multiples of 128";
  if (p.n % kAlignAB || p.k % kAlignAB) return "N and K must be multiples of 16 bytes";
  if (kDepthGrouped && kBlockScaled && (p.m <= 0 || p.m % kScaleBlock)) return "M must be a positive multiple of 128";
  if (kDepthGrouped && !kBlockScaled && (p.m <= 0 || p.m % kAlignAB)) return "M must be a positive multiple of 16 bytes";
  if (kDepthGrouped && p.num_groups > 65535) return "at most 65535 groups";  // fill_skipped_groups' grid.y
  DeviceGuard guard(p.device);
  size_t arrays = 0;
  GroupArrays arr = carve(p.workspace, p.num_groups, &arrays);
  typename Gemm::Arguments args = arguments(arr, p.num_groups, p.device, p.swizzle > 0 ? p.swizzle : 1);
  if (p.workspace_bytes < arrays + round_up(Gemm::get_workspace_size(args))) return "workspace too small";
  auto stream = static_cast<cudaStream_t>(p.stream);

  constexpr int kThreads = 128;
  fill_group_arrays<Self><<<(p.num_groups + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      arr, p.group_ends, p.num_groups, p.m, p.n, p.k, p.a, p.a_scales, p.b, p.b_scales, p.d);
  if constexpr (kDepthGrouped && !kAccumulate) {
    // enough 16-byte stores per block to amortize its launch; at most 32 blocks per group
    int64_t group_elems = static_cast<int64_t>(p.m) * p.n;
    constexpr int kFillThreads = 256, kChunksPerThread = 16;
    int64_t chunks = group_elems * static_cast<int64_t>(sizeof(ElementD)) / 16;
    int64_t blocks = (chunks + kFillThreads * kChunksPerThread - 1) / (kFillThreads * kChunksPerThread);
    dim3 grid(static_cast<unsigned>(blocks < 32 ? blocks : 32), static_cast<unsigned>(p.num_groups));
    fill_skipped_groups<Self><<<grid, kFillThreads, 0, stream>>>(p.group_ends, group_elems, p.k, p.d);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cudaGetErrorString(err);

  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS cannot implement this grouped GEMM";
  if (gemm.initialize(args, arr.gemm_workspace, stream) != cutlass::Status::kSuccess) return "CUTLASS initialize failed";
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    err = cudaGetLastError();
    return err != cudaSuccess ? cudaGetErrorString(err) : "CUTLASS run failed";
  }
  return "";
}

}  // namespace detail
}  // namespace megamoe
