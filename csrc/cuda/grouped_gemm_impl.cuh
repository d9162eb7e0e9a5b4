// The grouped GEMM of grouped_gemm.h as one template over element type, B layout and tile
// configuration, on CUTLASS's Hopper pointer-array collectives: TMA loads, warp-specialized
// producer/consumer warpgroups, a persistent grid over every group's tiles.
//
// Group sizes are known only on the device (the routing plan is built there), so one small
// kernel turns group_ends into CUTLASS's per-group argument arrays and the GEMM reads them:
// no host sync, capturable in a CUDA graph.
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

// ElementAB: cutlass::float_e4m3_t (block-scaled) or cutlass::bfloat16_t.
// LayoutB: ColumnMajor = B[g] stored [N, K] (K contiguous); RowMajor = stored [K, N].
template <class ElementAB, class LayoutB_, class TileShape_, class ClusterShape_, class Schedule, class EpilogueSchedule>
struct GroupedGemm {
  using Element = ElementAB;
  static constexpr bool kBlockScaled = std::is_same_v<ElementAB, cutlass::float_e4m3_t>;
  static constexpr int kAlignAB = 16 / sizeof(ElementAB);
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = LayoutB_;
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;

  // Scales are K-major, as the protocol stores them: a_scales [M, K/128], b_scales [N/128, K/128].
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using StridePairA = std::conditional_t<kBlockScaled, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using StridePairB = std::conditional_t<kBlockScaled, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, 8,  // no source operand (beta = 0)
      ElementD, LayoutD*, 8, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementAB, StridePairA, kAlignAB,
      ElementAB, StridePairB, kAlignAB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
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
    args.epilogue = {{}, nullptr, arr.stride_d, arr.d, arr.stride_d};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
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

// One thread per group: its row range from group_ends, then every pointer, stride and layout
// CUTLASS reads for it. 64-bit offsets throughout (pools past 2^31 elements).
template <class G>
__global__ void fill_group_arrays(typename G::GroupArrays arr, const int32_t* group_ends, int num_groups, int n,
                                  int k, const void* a, const float* sfa, const void* b, const float* sfb, void* d) {
  using ElementAB = typename G::Element;
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= num_groups) return;
  int64_t start = g == 0 ? 0 : group_ends[g - 1];
  int m = static_cast<int>(group_ends[g] - start);
  arr.shapes[g] = typename G::GroupShape(m, n, k);
  arr.a[g] = static_cast<const ElementAB*>(a) + start * k;
  arr.b[g] = static_cast<const ElementAB*>(b) + static_cast<int64_t>(g) * n * k;
  arr.d[g] = static_cast<typename G::ElementD*>(d) + start * n;
  typename G::StrideA sa{};
  get<0>(sa) = k;  // A rows of K
  typename G::StrideB sb{};
  if constexpr (std::is_same_v<typename G::LayoutB, cutlass::layout::ColumnMajor>) {
    get<0>(sb) = k;  // B[g] as [N, K]: step K elements per n
  } else {
    get<1>(sb) = n;  // B[g] as [K, N]: step N elements per k
  }
  typename G::StrideD sd{};
  get<0>(sd) = n;
  arr.stride_a[g] = sa;
  arr.stride_b[g] = sb;
  arr.stride_d[g] = sd;
  if constexpr (G::kBlockScaled) {
    int64_t kb = k / kScaleBlock;
    arr.sfa[g] = sfa + start * kb;
    arr.sfb[g] = sfb + static_cast<int64_t>(g) * (n / kScaleBlock) * kb;
    arr.layout_sfa[g] = G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
    arr.layout_sfb[g] = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  }
}

template <class ElementAB, class LayoutB, class TileShape, class ClusterShape, class Schedule, class EpilogueSchedule>
const char* GroupedGemm<ElementAB, LayoutB, TileShape, ClusterShape, Schedule, EpilogueSchedule>::run(
    const GroupedGemmArgs& p) {
  using Self = GroupedGemm;
  if (p.num_groups <= 0) return "num_groups must be positive";
  if (kBlockScaled && (p.n % kScaleBlock || p.k % kScaleBlock)) return "N and K must be multiples of 128";
  if (p.n % kAlignAB || p.k % kAlignAB) return "N and K must be multiples of 16 bytes";
  DeviceGuard guard(p.device);
  size_t arrays = 0;
  GroupArrays arr = carve(p.workspace, p.num_groups, &arrays);
  typename Gemm::Arguments args = arguments(arr, p.num_groups, p.device, p.swizzle > 0 ? p.swizzle : 1);
  if (p.workspace_bytes < arrays + round_up(Gemm::get_workspace_size(args))) return "workspace too small";
  auto stream = static_cast<cudaStream_t>(p.stream);

  constexpr int kThreads = 128;
  fill_group_arrays<Self><<<(p.num_groups + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      arr, p.group_ends, p.num_groups, p.n, p.k, p.a, p.a_scales, p.b, p.b_scales, p.d);
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
