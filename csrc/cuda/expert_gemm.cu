// Host side of expert_gemm.h: checks, the two TMA descriptors, the persistent launch.
#include <mutex>
#include <unordered_map>

#include "cutlass/cuda_host_adapter.hpp"
#include "expert_gemm.h"
#include "expert_gemm_sm90.cuh"

namespace megamoe {
namespace {

using expert_sm90::Params;

// A row-major byte matrix [rows, cols] as TMA reads it: box_rows x 128 boxes, 128-byte swizzle (the
// layout GMMA::Layout_K_SW128_Atom describes) for e4m3; packed E2M1 rows (the kMx B) in plain
// box_rows x 64 boxes, as the expanding warps read them. Zeros past the last row.
const char* encode(CUtensorMap* map, const void* base, int64_t rows, int64_t cols, uint32_t box_rows,
                   bool packed = false) {
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols)};
  cuuint32_t box[2] = {packed ? expert_sm90::kBlockK / 2 : expert_sm90::kBlockK, box_rows};
  cuuint32_t element_strides[2] = {1, 1};
  CUresult r = cutlass::call_cuTensorMapEncodeTiled(
      map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, packed ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? "" : "cuTensorMapEncodeTiled failed";
}

// Per device and kernel: the grid (one CTA per SM, or as many 2-CTA clusters as fit at once).
struct Launch {
  bool ready = false;
  int grid = 0;
};

template <bool kSwiGLU, int kCluster, bool kStaged, bool kStagger, bool kDeferred, bool kMx = false>
const char* run(const Params& p, int device, cudaStream_t stream) {
  static std::mutex mutex;
  static std::unordered_map<int, Launch> launches;
  // + alignment slack
  constexpr int buffers = expert_sm90::staging_buffers(kStaged, kDeferred);
  constexpr size_t smem = sizeof(expert_sm90::SharedStorage<buffers, kMx>) + 1024;
  static_assert(smem <= 227 * 1024, "shared memory per block on sm_90");
  auto kernel = expert_sm90::expert_gemm_kernel<kSwiGLU, kCluster, kStaged, kStagger, kDeferred, kMx>;
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(expert_sm90::kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int grid;
  {
    std::lock_guard<std::mutex> lock(mutex);
    Launch& l = launches[device];
    if (!l.ready) {
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
        return "cudaFuncSetAttribute failed";
      int sms = 0;
      if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return "cudaDeviceGetAttribute failed";
      l.grid = sms;
      if (kCluster > 1) {  // a persistent grid larger than what runs at once would serialize
        config.gridDim = dim3(sms / kCluster * kCluster);
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess || clusters <= 0)
          return "cudaOccupancyMaxActiveClusters failed";
        l.grid = kCluster * clusters;
      }
      l.ready = true;
    }
    grid = l.grid;
  }
  config.gridDim = dim3(grid);
  cudaError_t err = cudaLaunchKernelEx(&config, kernel, p);
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

// expert_gemm.h: bits 2 and 3 only with the staged schedule, bit 3 only for SwiGLU, bit 4 with any
bool valid_variant(int variant, bool swiglu, bool mx = false) {
  if (variant < 0 || variant > (mx ? 63 : 31) || ((variant & 8) && !swiglu)) return false;
  return !((variant & 2) && (variant & 12));
}

// Clusters of 2 only: 4-CTA clusters sharing A (a quarter each) measured 6-19% slower than
// pairs in every GEMM of bench_expert_gemm (2026-12-04, docs/decisions.md).
template <bool kSwiGLU, bool kStaged, bool kStagger, bool kDeferred, bool kMx = false>
const char* run_clustered(int cluster, const Params& p, int device, cudaStream_t stream) {
  if (cluster == 2) return run<kSwiGLU, 2, kStaged, kStagger, kDeferred, kMx>(p, device, stream);
  return run<kSwiGLU, 1, kStaged, kStagger, kDeferred, kMx>(p, device, stream);
}

// kMx: B packed E2M1 [G, N, K/2] with b_shifts and b_scales (quant.mx_weight_shifts); the plain GEMM
// on the staged schedule (variant bits 0, 2 and 4)
template <bool kSwiGLU, bool kMx = false>
const char* launch(const ExpertGemmArgs& a) {
  if (a.num_groups <= 0 || a.num_groups > expert_sm90::kMaxGroups) return "num_groups must be in [1, 1024]";
  if (a.n % (kSwiGLU ? 2 * expert_sm90::kBlockN : expert_sm90::kBlockN) || a.k % expert_sm90::kBlockK || a.k <= 0)
    return kSwiGLU ? "N must be a multiple of 256 and K a positive multiple of 128"
                   : "N and K must be multiples of 128 (K > 0)";
  if (kSwiGLU && (a.chunk <= 0 || a.chunk % expert_sm90::kBlockN || (a.n / 2) % a.chunk))
    return "chunk must be a multiple of 128 dividing N/2";
  if (!valid_variant(a.variant, kSwiGLU, kMx))
    return kSwiGLU ? "variant must be in [0, 31], bit 1 without bits 2 and 3 (expert_gemm.h)"
           : kMx   ? "variant must be in [0, 63] without bit 3, bit 1 without bit 2 (expert_gemm.h)"
                   : "variant must be in [0, 31] without bit 3, bit 1 without bit 2 (expert_gemm.h)";
  if (kMx && (a.variant & 2)) return "E2M1 weights run on the staged schedule only: variant without bit 1";
  if (kMx && (a.n % expert_sm90::kBlockN || !a.b_shifts)) return "E2M1 weights need N % 128 == 0 and b_shifts";
  // the staged epilogue's 16-byte row stores
  if (!(a.variant & 2) && ((reinterpret_cast<uintptr_t>(a.out) | reinterpret_cast<uintptr_t>(a.act)) % 16))
    return "out and act must be 16-byte aligned";
  if (a.pool_rows == 0) return "";
  const int units_per_tile = kSwiGLU ? a.n / (2 * expert_sm90::kBlockN) : a.n / expert_sm90::kBlockN;
  const int cluster = !(a.variant & 1) && units_per_tile % 2 == 0 ? 2 : 1;
  Params p{};
  // A's box: a pair CTA's half of the 128-row tile (without a pair, two 64-row loads)
  if (const char* e = encode(&p.tma_a, a.a, a.pool_rows, a.k, expert_sm90::kBlockM / 2); e[0]) return e;
  if (const char* e = encode(&p.tma_b, a.b, int64_t(a.num_groups) * a.n, kMx ? a.k / 2 : a.k, expert_sm90::kBlockN, kMx);
      e[0])
    return e;
  p.b_shifts = a.b_shifts;
  p.a_scales = a.a_scales;
  p.b_scales = a.b_scales;
  p.group_ends = a.group_ends;
  p.row_weights = a.row_weights;
  p.out = static_cast<__nv_bfloat16*>(a.out);
  p.act = static_cast<uint8_t*>(a.act);
  p.act_scales = a.act_scales;
  p.num_groups = a.num_groups;
  p.pool_rows = a.pool_rows;
  p.n = a.n;
  p.k = a.k;
  p.chunk = a.chunk;
  p.clamp = a.clamp;
  p.has_clamp = a.has_clamp ? 1 : 0;
  p.skip_dead = (a.variant & 16) ? 1 : 0;
  p.math_expand = kMx && (a.variant & 32) ? 1 : 0;

  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const bool stagger = !(a.variant & 4);
  if constexpr (kMx) {
    return stagger ? run_clustered<false, true, true, false, true>(cluster, p, a.device, stream)
                   : run_clustered<false, true, false, false, true>(cluster, p, a.device, stream);
  }
  if (a.variant & 2) return run_clustered<kSwiGLU, false, false, false>(cluster, p, a.device, stream);
  if constexpr (kSwiGLU) {
    if (!(a.variant & 8))
      return stagger ? run_clustered<true, true, true, true>(cluster, p, a.device, stream)
                     : run_clustered<true, true, false, true>(cluster, p, a.device, stream);
  }
  return stagger ? run_clustered<kSwiGLU, true, true, false>(cluster, p, a.device, stream)
                 : run_clustered<kSwiGLU, true, false, false>(cluster, p, a.device, stream);
}

}  // namespace

const char* expert_gemm(const ExpertGemmArgs& args) {
  int previous = -1;
  cudaGetDevice(&previous);
  if (previous != args.device) cudaSetDevice(args.device);
  const char* e = launch<false>(args);
  if (previous >= 0 && previous != args.device) cudaSetDevice(previous);
  return e;
}

const char* expert_gemm_mx(const ExpertGemmArgs& args) {
  int previous = -1;
  cudaGetDevice(&previous);
  if (previous != args.device) cudaSetDevice(args.device);
  const char* e = launch<false, true>(args);
  if (previous >= 0 && previous != args.device) cudaSetDevice(previous);
  return e;
}

const char* expert_gemm_swiglu(const ExpertGemmArgs& args) {
  int previous = -1;
  cudaGetDevice(&previous);
  if (previous != args.device) cudaSetDevice(args.device);
  const char* e = launch<true>(args);
  if (previous >= 0 && previous != args.device) cudaSetDevice(previous);
  return e;
}

}  // namespace megamoe
