// FP8 block-scaled grouped GEMM for the expert pool (see grouped_gemm.h), on CUTLASS's Hopper
// pointer-array collectives: TMA loads, warp-specialized producer/consumer warpgroups, a
// persistent grid over every group's tiles, and the 1x128 (A) / 128x128 (B) scales applied to
// each 128-deep partial product in fp32 before it is accumulated (DeepSeek-V3's recipe).
//
// Group sizes are known only on the device (the routing plan is built there), so one small
// kernel turns group_ends into CUTLASS's per-group argument arrays and the GEMM reads them:
// no host sync, capturable in a CUDA graph.

#include "grouped_gemm.h"

#include <cuda_runtime.h>

#include <mutex>
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

namespace megamoe {
namespace {

using namespace cute;

constexpr int kScaleBlock = 128;  // the recipe's scale block along K (and along N for B)

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // pool rows, K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K] per expert, K contiguous
using LayoutD = cutlass::layout::RowMajor;

// 128x128 output tiles, 128 deep (one scale block per K step); a 1x2 cluster shares each A
// tile between two CTAs of neighbouring N tiles through TMA multicast.
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _2, _1>;

// Scales are K-major, as the protocol stores them: a_scales [M, K/128], b_scales [N/128, K/128].
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock,
                                                              cute::GMMA::Major::K, cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutD*, 8,  // no source operand (beta = 0)
    ElementD, LayoutD*, 8,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, cute::tuple<LayoutA*, LayoutSFA*>, 16,
    ElementB, cute::tuple<LayoutB*, LayoutSFB*>, 16,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using GroupShape = ProblemShape::UnderlyingProblemShape;
using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;

// CUTLASS's per-group argument arrays, carved out of the caller's workspace.
struct GroupArrays {
  GroupShape* shapes;
  const ElementA** a;
  const ElementB** b;
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

constexpr size_t kAlign = 256;

size_t round_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

size_t group_arrays_bytes(int g) {
  return round_up(sizeof(GroupShape) * g) + 5 * round_up(sizeof(void*) * g) + round_up(sizeof(StrideA) * g) +
         round_up(sizeof(StrideB) * g) + round_up(sizeof(StrideD) * g) + round_up(sizeof(LayoutSFA) * g) +
         round_up(sizeof(LayoutSFB) * g);
}

GroupArrays carve(void* workspace, int g) {
  char* p = static_cast<char*>(workspace);
  auto take = [&](size_t bytes) {
    char* out = p;
    p += round_up(bytes);
    return static_cast<void*>(out);
  };
  GroupArrays arr;
  arr.shapes = static_cast<GroupShape*>(take(sizeof(GroupShape) * g));
  arr.a = static_cast<const ElementA**>(take(sizeof(void*) * g));
  arr.b = static_cast<const ElementB**>(take(sizeof(void*) * g));
  arr.d = static_cast<ElementD**>(take(sizeof(void*) * g));
  arr.sfa = static_cast<const float**>(take(sizeof(void*) * g));
  arr.sfb = static_cast<const float**>(take(sizeof(void*) * g));
  arr.stride_a = static_cast<StrideA*>(take(sizeof(StrideA) * g));
  arr.stride_b = static_cast<StrideB*>(take(sizeof(StrideB) * g));
  arr.stride_d = static_cast<StrideD*>(take(sizeof(StrideD) * g));
  arr.layout_sfa = static_cast<LayoutSFA*>(take(sizeof(LayoutSFA) * g));
  arr.layout_sfb = static_cast<LayoutSFB*>(take(sizeof(LayoutSFB) * g));
  arr.gemm_workspace = p;
  return arr;
}

// One thread per group: its row range from group_ends, then every pointer and layout CUTLASS
// reads for it. 64-bit offsets throughout (pools past 2^31 elements).
__global__ void fill_group_arrays(GroupArrays arr, const int32_t* group_ends, int num_groups, int n, int k,
                                  const ElementA* a, const float* sfa, const ElementB* b, const float* sfb,
                                  ElementD* d) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= num_groups) return;
  int64_t start = g == 0 ? 0 : group_ends[g - 1];
  int m = static_cast<int>(group_ends[g] - start);
  int64_t kb = k / kScaleBlock;
  arr.shapes[g] = GroupShape(m, n, k);
  arr.a[g] = a + start * k;
  arr.b[g] = b + static_cast<int64_t>(g) * n * k;
  arr.d[g] = d + start * n;
  arr.sfa[g] = sfa + start * kb;
  arr.sfb[g] = sfb + static_cast<int64_t>(g) * (n / kScaleBlock) * kb;
  StrideA sa{};
  get<0>(sa) = k;
  StrideB sb{};
  get<0>(sb) = k;
  StrideD sd{};
  get<0>(sd) = n;
  arr.stride_a[g] = sa;
  arr.stride_b[g] = sb;
  arr.stride_d[g] = sd;
  arr.layout_sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  arr.layout_sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
}

// The SM count and the clusters that fit at once, read once per device (the occupancy query
// is a host call that costs far more than a launch).
cutlass::KernelHardwareInfo hardware_info(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, cutlass::KernelHardwareInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it == cache.end()) {
    it = cache.emplace(device, cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device)).first;
  }
  return it->second;
}

typename Gemm::Arguments make_arguments(const GroupArrays& arr, int num_groups, int device) {
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {num_groups, arr.shapes, nullptr},  // no host shapes: sizes are read on the device
      {arr.a, arr.stride_a, arr.b, arr.stride_b, arr.sfa, arr.layout_sfa, arr.sfb, arr.layout_sfb},
      {{}, nullptr, arr.stride_d, arr.d, arr.stride_d},
      hardware_info(device)};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

// Restores the caller's current device on exit.
struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous);
    if (previous != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (now != previous && previous >= 0) cudaSetDevice(previous);
  }
};

}  // namespace

size_t fp8_grouped_gemm_workspace_bytes(int num_groups, int device) {
  DeviceGuard guard(device);
  GroupArrays arr = carve(nullptr, num_groups);
  return group_arrays_bytes(num_groups) + round_up(Gemm::get_workspace_size(make_arguments(arr, num_groups, device)));
}

const char* fp8_grouped_gemm(const Fp8GroupedGemmArgs& p) {
  if (p.num_groups <= 0) return "num_groups must be positive";
  if (p.n % kScaleBlock || p.k % kScaleBlock) return "N and K must be multiples of 128";
  DeviceGuard guard(p.device);
  GroupArrays arr = carve(p.workspace, p.num_groups);
  typename Gemm::Arguments args = make_arguments(arr, p.num_groups, p.device);
  size_t need = group_arrays_bytes(p.num_groups) + round_up(Gemm::get_workspace_size(args));
  if (p.workspace_bytes < need) return "workspace too small";
  auto stream = static_cast<cudaStream_t>(p.stream);

  constexpr int kThreads = 128;
  fill_group_arrays<<<(p.num_groups + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      arr, p.group_ends, p.num_groups, p.n, p.k, static_cast<const ElementA*>(p.a), p.a_scales,
      static_cast<const ElementB*>(p.b), p.b_scales, static_cast<ElementD*>(p.d));
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

}  // namespace megamoe
