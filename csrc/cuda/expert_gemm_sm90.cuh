// The fp8 expert GEMM of the forward as our own persistent, warp-specialized Hopper kernel, with
// the epilogues the CUTLASS collectives cannot express: the L1 GEMM with clamp + SwiGLU + topk
// weight + 1x128 e4m3 requantization in registers (no pre-activation round trip through a
// separate kernel), and the plain bf16 store for L2 and the dgrads.
//
// Layout of the work (expert_gemm.h has the operands):
// - A is the pool as one 2-D tensor [P, K] and B the stacked weights as one 2-D tensor [G*N, K]:
//   two TMA descriptors for the whole call, none per group (the pointer-array CUTLASS kernel
//   rewrites its descriptors at every group change).
// - A tile is 128 pool rows starting at a group's start + 128 i, so a group's last tile may
//   read rows of the next group (or zeros past P); the epilogue stores only the group's rows.
//   The tile count per group is known only on the device: each CTA builds the prefix over the
//   groups once, in shared memory, and walks the same work list as every other CTA.
// - Work units are (m tile, 128-wide output block), m-major, so the ~132 units in flight share
//   two or three experts' weights through L2 and each weight block comes from HBM about once.
// - With an even number of blocks per m tile, CTAs run in pairs (2-CTA clusters) on the same m
//   tile and neighbouring blocks: each CTA loads half of the A tile and multicasts it to both, so
//   A's L2 reads halve; at 128x128x128 fp8 tiles the L2 -> SM feed, ~11 TB/s at the dense rate,
//   limits the main loop (Nsight Compute: CUTLASS's L1 at S4 runs at 90% of L2 throughput).
//   The kernel takes clusters of 4 as well (kCluster), but those measured slower than pairs.
// - Warpgroup 0 is the producer (one thread issues every TMA load); warpgroups 1-2 each compute
//   64 rows of the 128-row tile with m64n128k32 wgmma. fp8: each 128-deep K block goes into a
//   scratch accumulator, then is promoted into the fp32 result times A's row scales and B's block
//   scale (DeepSeek-V3's recipe); while one math warpgroup promotes, the other's wgmmas run.
// - SwiGLU: one unit computes the gate block, keeps it as packed bf16 (the pre-activation the
//   backward reads is stored bf16, so SwiGLU is computed from the same rounded values the split
//   path's SwiGLU kernel reads), then the matching up block of the same rows, and quantizes
//   silu(gate) * up * w_row per 128 columns: one unit's output is exactly one scale block.
// - kStaged (the default schedule): each math warpgroup walks its output blocks as one stream of
//   K blocks, and a finished block's epilogue runs after the next block's first wgmmas are issued,
//   so the tensor cores work through the epilogue. A SwiGLU up block's epilogue is deferred
//   (kDeferred, the default): staged beside the gate block, then run in passes under the next
//   unit's wgmmas; in place it needs the registers of the wgmmas in flight and runs just before
//   them (variant + 8). The epilogue goes through shared memory: the
//   accumulator fragments (8 rows x 16 bytes per warp store, one L1 wavefront per row) are written
//   to a padded buffer and copied out as whole 256-byte rows. Without kStaged (the first version,
//   kept for comparisons) the fragments are stored to global memory directly after each block.
// - skip_dead: a group's last tile often ends in its first 64 rows (S1: ~192 rows per expert, so
//   half the experts' second tile). Its dead 64-row share of A is then not loaded (the stage
//   expects fewer bytes) and, on the staged schedule (but for the in-place SwiGLU epilogue), the
//   warpgroup of those rows issues no wgmma:
//   it still waits for each stage and releases it, so the pipeline's phases stay in step, and
//   promotes a stale scratch into rows nothing stores.
// - kMx (plain GEMMs only): B is the MX recipe's E2M1 weights, 4 bits each in HBM and in L2. TMA
//   brings a stage's packed rows (64 bytes per 128-deep K block) with each row's four 1x32 shifts
//   (quant.mx_weight_shifts: the block's largest ue8m0 exponent less the row's own, clamped at
//   15); warps 1-3 of the producer warpgroup expand them into the e4m3 B tile in its 128-byte
//   swizzled layout (a table per shift: the E2M1 magnitudes times 2^-shift, rounded as e4m3;
//   two byte permutes per 4 elements), and the math warpgroups wait for that instead of the TMA.
//   b_scales holds the 128x128 blocks' 2^max, so the product is quant.fold_mx_weight's bit for bit.
//   math_expand: three converter warps bound the main loop (2026-12-07: 1.5-1.9x the folded
//   weights' time), so the 256 math threads take part too: after issuing a stage's wgmmas each
//   expands its share of the stage two ahead (352 converters, one or two tasks each), which their
//   wgmmas and the other warpgroup's cover; two ahead, so no warpgroup waits on the one staggered
//   behind it.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/numeric_types.h"

namespace megamoe {
namespace expert_sm90 {

using namespace cute;

constexpr int kBlockM = 128;   // pool rows per tile: two math warpgroups of 64
constexpr int kBlockN = 128;   // output columns per block (a weight scale block)
constexpr int kBlockK = 128;   // one 128-byte swizzle row of e4m3, and one scale block deep
constexpr int kThreads = 384;  // producer warpgroup + two math warpgroups
constexpr int kMaxGroups = 1024;
constexpr int kMathThreads = 256;
// The staging buffer of a math warpgroup: its 64 rows of a 128-column block, rows padded by 16
// bytes so the fragment writes (8 rows x 4 threads per warp) fall into 32 distinct banks.
constexpr int kStagingPitch = 2 * kBlockN + 16;

using Element = cutlass::float_e4m3_t;
using TiledMma = decltype(make_tiled_mma(
    SM90::GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kBlockK>>>(),
    Layout<Shape<_2, _1, _1>>{}));

// 32 KB per stage (A and B tiles), beside the math warpgroups' staging buffers (kBuffers of 17 KB:
// none for the first schedule, one each for the staged schedule, two each, a unit's gate and up
// blocks, for its deferred SwiGLU epilogue): 6, 5 or 4 stages, what fits in 227 KB.
template <int kBuffers, bool kMx = false>
struct alignas(1024) SharedStorage {
  // kMx: 4 stages, each with its packed B rows (8.5 KB more a stage)
  static constexpr int kStages = kMx ? 4 : kBuffers == 0 ? 6 : kBuffers == 2 ? 5 : 4;
  using LayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                         Shape<Int<kBlockM>, Int<kBlockK>, Int<kStages>>{}));
  using LayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                         Shape<Int<kBlockN>, Int<kBlockK>, Int<kStages>>{}));
  cute::array_aligned<Element, cosize_v<LayoutA>, 1024> a;
  cute::array_aligned<Element, cosize_v<LayoutB>, 1024> b;
  cute::array_aligned<uint8_t, kBuffers ? kBuffers * 64 * kStagingPitch : 16, 16> staging;
  // kMx: each stage's B as loaded (packed E2M1 rows, 64 bytes a row, and their 4 shifts a row)
  cute::array_aligned<uint8_t, kMx ? kStages * kBlockN * kBlockK / 2 : 16, 128> packed;
  cute::array_aligned<uint8_t, kMx ? kStages * kBlockN * 4 : 16, 128> shifts;
  uint32_t lut[kMx ? 32 : 1];  // kMx: [shift 0..15][magnitudes 0-3, 4-7] as e4m3 bytes
  uint64_t full[kStages];
  uint64_t empty[kStages];
  uint64_t converted[kStages];  // kMx: the stage's B tile expanded (the math warpgroups wait here)
  int tile_ends[kMaxGroups];   // cumulative m tiles of groups 0..g
  int group_ends[kMaxGroups];  // the plan's cumulative row ends

  // the barrier a math warpgroup waits on before reading a stage
  __device__ __forceinline__ uint64_t* ready(int stage) { return kMx ? &converted[stage] : &full[stage]; }
};

// The staging buffers a schedule needs (SharedStorage).
constexpr int staging_buffers(bool staged, bool deferred) { return !staged ? 0 : deferred ? 4 : 2; }

struct Params {
  CUtensorMap tma_a;           // e4m3 [P, K], box 64 rows x 128, 128-byte swizzle
  CUtensorMap tma_b;           // e4m3 [G*N, K], same box (kMx: packed E2M1 [G*N, K/2], box 128 rows x 64 bytes)
  const float* a_scales;       // [P, K/128]
  const float* b_scales;       // [G, N/128, K/128]
  const int32_t* group_ends;   // [G]
  const float* row_weights;    // SwiGLU: [P], the rows' topk weights
  __nv_bfloat16* out;          // [P, N]: the product (plain) or the pre-activations (SwiGLU)
  uint8_t* act;                // SwiGLU: e4m3 [P, N/2]
  float* act_scales;           // SwiGLU: [P, N/256]
  int num_groups, pool_rows, n, k;
  int chunk;                   // SwiGLU: gate/up interleave of B's rows (and of out's columns)
  float clamp;
  int has_clamp;
  const uint8_t* b_shifts;     // kMx: [G, N/128, K/128, 128, 4], quant.mx_weight_shifts
  int skip_dead;               // a tile's rows past its group's end: no A load, no wgmma (see below)
  int math_expand;             // kMx: the math warpgroups share the expansion, two stages ahead
};

// The unit's m tile: its group, first row and the group's row end.
struct Tile {
  int group, m0, m_end, block;
};

template <class Storage>
__device__ __forceinline__ Tile decode(const Storage& s, int num_groups, int units_per_tile, int unit) {
  int t = unit / units_per_tile;
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {  // first group whose cumulative tile count exceeds t
    int mid = (lo + hi) >> 1;
    if (s.tile_ends[mid] > t) hi = mid; else lo = mid + 1;
  }
  int first_tile = lo ? s.tile_ends[lo - 1] : 0;
  int start = lo ? s.group_ends[lo - 1] : 0;
  return {lo, start + (t - first_tile) * kBlockM, s.group_ends[lo], unit % units_per_tile};
}

// B row (and output column) of a SwiGLU unit's gate block: activation columns [128 b, 128 b + 128)
// come from the interleave's chunk holding them; the up block is `chunk` rows further.
__device__ __forceinline__ int gate_row(int block, int chunk) {
  int col = block * kBlockN;
  return (col / chunk) * (2 * chunk) + col % chunk;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float2 unpack_bf16(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}

// x / scale correctly rounded, clamped to +-448 with NaN kept, as quant.quantize_act.
// recip = 1 / scale correctly rounded (once per block); two FMA corrections make the quotient the
// correctly rounded one for |x / scale| <= 448 (the block's amax bounds x), as the Triton
// quantizers' divide_rn does, at a fraction of a full division's cost.
__device__ __forceinline__ float e4m3_quotient(float x, float scale, float recip) {
  float q0 = x * recip;
  float q = fmaf(fmaf(-q0, scale, x), recip, q0);
  q = fmaf(fmaf(-q, scale, x), recip, q);
  q = q0 == 0.0f ? q0 : q;  // +-0 keeps its sign (the corrections' +0 remainders would drop it)
  return q != q ? q : fminf(fmaxf(q, -448.0f), 448.0f);
}

// silu(min(g, c)) * clamp(u, -c, c) * w from the bf16-rounded gate and up values.
// min / max that keep a NaN operand (torch.clamp's rule; fminf / fmaxf return the other one)
__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float2 swiglu_pair(const Params& p, uint32_t gate_bits, uint32_t up_bits, float w) {
  float2 g = unpack_bf16(gate_bits), u = unpack_bf16(up_bits);
  if (p.has_clamp) {
    g.x = min_nan(g.x, p.clamp);
    g.y = min_nan(g.y, p.clamp);
    u.x = min_nan(max_nan(u.x, -p.clamp), p.clamp);
    u.y = min_nan(max_nan(u.y, -p.clamp), p.clamp);
  }
  // approximate division, as the Triton SwiGLU kernel's
  return make_float2(__fdividef(g.x, 1.0f + __expf(-g.x)) * u.x * w, __fdividef(g.y, 1.0f + __expf(-g.y)) * u.y * w);
}

// One 1x128 e4m3 scale of a row from this thread's 32 values of it (acc[4 i + 2 r], + 1) and its
// quad's: the amax as bits (a NaN's exceed every finite value's, so a NaN row gets a NaN scale).
__device__ __forceinline__ float row_scale(const float* acc, int r) {
  uint32_t amax_bits = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    amax_bits = max(amax_bits, __float_as_uint(acc[4 * i + 2 * r]) & 0x7fffffffu);
    amax_bits = max(amax_bits, __float_as_uint(acc[4 * i + 2 * r + 1]) & 0x7fffffffu);
  }
  amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, 1));
  amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, 2));
  float amax = __uint_as_float(amax_bits);
  return __fdiv_rn(amax != amax ? amax : fmaxf(amax, 1e-4f), 448.0f);
}

__device__ __forceinline__ void warpgroup_sync(int wg) {  // named barrier 1 + wg, the warpgroup's 128 threads
  asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
}

// A math warpgroup's 64 staged rows (kChunks 16-byte pieces each) to dst rows row0.., stride
// bytes apart, rows at or past m_end skipped: two whole rows per warp store.
template <int kChunks>
__device__ __forceinline__ void copy_out(const uint8_t* staging, uint8_t* dst, size_t stride, int row0, int m_end,
                                         int wt) {
#pragma unroll
  for (int c = wt; c < 64 * kChunks; c += 128) {
    int r = c / kChunks, j = c % kChunks;
    if (row0 + r < m_end) {
      uint4 v = *reinterpret_cast<const uint4*>(staging + r * kStagingPitch + 16 * j);
      *reinterpret_cast<uint4*>(dst + size_t(row0 + r) * stride + 16 * j) = v;
    }
  }
}

template <bool kSwiGLU, int kCluster>
__device__ void math(const Params& p, SharedStorage<0>& s, int first_unit, int unit_stride, int total_units,
                     int units_per_tile);
template <bool kSwiGLU, int kCluster, bool kStagger, bool kDeferred, bool kMx>
__device__ void math_staged(const Params& p, SharedStorage<staging_buffers(true, kDeferred), kMx>& s,
                            int first_unit, int unit_stride, int total_units, int units_per_tile);

// E2M1 magnitudes by index (quant.E2M1_VALUES)
__device__ constexpr float kE2M1Values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr int kExpandThreads = 96;  // warps 1-3 of the producer warpgroup (kMx)
constexpr int kSharedExpandThreads = kExpandThreads + kMathThreads;  // math_expand: and the math warpgroups
template <class Storage>
__device__ void expand_e2m1(Storage& s, int steps, int converters);
template <int kConverters, class Storage>
__device__ void convert_stage(Storage& s, int stage, uint32_t phase, int tid);

// kCluster: 1, or the CTA is one of a cluster of 2 or 4 CTAs on neighbouring blocks of one m tile
// (units_per_tile a multiple of kCluster), each loading 1/kCluster of the A tile for all by multicast.
// kStaged: the staged schedule, kStagger: its math warpgroups a K block apart, kDeferred: its
// SwiGLU epilogue deferred into passes under the next unit's wgmmas (math_staged). kMx: B is
// packed E2M1, expanded in shared memory (plain staged GEMMs only).
template <bool kSwiGLU, int kCluster, bool kStaged, bool kStagger, bool kDeferred, bool kMx = false>
__global__ void __launch_bounds__(kThreads, 1) expert_gemm_kernel(const __grid_constant__ Params p) {
  static_assert(!kMx || (!kSwiGLU && kStaged), "E2M1 weights: the plain GEMM on the staged schedule");
  using Storage = SharedStorage<staging_buffers(kStaged, kDeferred), kMx>;
  constexpr int kStages = Storage::kStages;
  extern __shared__ char smem_raw[];
  // aligned by an offset from smem_raw (not through an integer), so accesses stay shared-memory ones
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  Storage& s = *reinterpret_cast<Storage*>(smem_raw + ((1024u - (smem_base & 1023u)) & 1023u));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = p.num_groups, KB = p.k / kBlockK;
  const int units_per_tile = kSwiGLU ? p.n / (2 * kBlockN) : p.n / kBlockN;
  const int cta = kCluster > 1 ? int(cute::block_rank_in_cluster()) : 0;
  // units are taken kCluster at a time by a cluster: (its first unit, the stride between its units)
  const int first_unit = (blockIdx.x / kCluster) * kCluster + cta;
  const int unit_stride = gridDim.x;

  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      cutlass::arch::ClusterTransactionBarrier::init(&s.full[st], 1);
      // one arrive per math warp of every CTA whose loads write this stage
      cutlass::arch::ClusterBarrier::init(&s.empty[st], kCluster * kMathThreads / 32);
      if constexpr (kMx)
        cutlass::arch::ClusterBarrier::init(&s.converted[st], p.math_expand ? kSharedExpandThreads : kExpandThreads);
    }
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(&p.tma_a);
    cute::prefetch_tma_descriptor(&p.tma_b);
  }
  if constexpr (kMx) {  // the expansion tables: entry [shift][i] = e4m3(kE2M1Values[i] * 2^-shift)
    if (threadIdx.x >= 128 && threadIdx.x < 256) {
      const int t = threadIdx.x - 128, shift = t >> 3;
      const float v = kE2M1Values[t & 7] * __uint_as_float(uint32_t(127 - shift) << 23);
      reinterpret_cast<uint8_t*>(s.lut)[t] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    }
  }
  if (warp == 0) {  // per-group m-tile prefix, 32 groups per step
    int carry = 0;
    for (int g0 = 0; g0 < G; g0 += 32) {
      int g = g0 + lane;
      int end = g < G ? p.group_ends[g] : 0;
      int start = (g < G && g > 0) ? p.group_ends[g - 1] : 0;
      int tiles = g < G ? max(0, (end - start + kBlockM - 1) / kBlockM) : 0;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        int t = __shfl_up_sync(0xffffffffu, tiles, off);
        if (lane >= off) tiles += t;
      }
      if (g < G) {
        s.tile_ends[g] = carry + tiles;
        s.group_ends[g] = end;
      }
      carry += __shfl_sync(0xffffffffu, tiles, 31);
    }
  }
  if constexpr (kCluster > 1) {  // the peers' barriers exist before any multicast reaches them
    if constexpr (kMx) __syncthreads();  // the tables written above, for the expanding warps
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  } else {
    __syncthreads();
  }
  const int total_units = (G > 0 ? s.tile_ends[G - 1] : 0) * units_per_tile;

  if (threadIdx.x < 128) {  // producer warpgroup
    // kMx: its warps 1-3 expand B (more registers than issuing TMA; the math warpgroups give 8)
    cutlass::arch::warpgroup_reg_dealloc<kMx ? 56 : 40>();
    if (kMx && threadIdx.x >= 32) {
      const int my_units = first_unit < total_units ? (total_units - 1 - first_unit) / unit_stride + 1 : 0;
      expand_e2m1(s, my_units * KB, p.math_expand ? kSharedExpandThreads : kExpandThreads);
    } else if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int unit = first_unit; unit < total_units; unit += unit_stride) {
        Tile tile = decode(s, G, units_per_tile, unit);
        int row0 = kSwiGLU ? gate_row(tile.block, p.chunk) : tile.block * kBlockN;
        // the A rows this stage receives: every CTA of a cluster counts the same live shares
        // (the A descriptor's box is a share, expert_gemm.cu; without a cluster two 64-row loads)
        constexpr int kShareRows = kCluster > 1 ? kBlockM / kCluster : 64;
        int a_rows = kBlockM;
        if (p.skip_dead) a_rows = min(kBlockM, (tile.m_end - tile.m0 + kShareRows - 1) / kShareRows * kShareRows);
        const bool share_live = cta * kShareRows < a_rows;
#pragma unroll 1
        for (int half = 0; half < (kSwiGLU ? 2 : 1); ++half) {
          int b_row = tile.group * p.n + row0 + half * p.chunk;
#pragma unroll 1
          for (int kb = 0; kb < KB; ++kb) {
            cutlass::arch::ClusterBarrier::wait(&s.empty[stage], phase ^ 1);
            // B: e4m3 rows, or (kMx) packed E2M1 rows and their shifts
            constexpr int kBBytes = kMx ? kBlockN * kBlockK / 2 + kBlockN * 4 : kBlockN * kBlockK;
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[stage],
                                                                            kBBytes + a_rows * kBlockK);
            Element* a_stage = s.a.data() + stage * kBlockM * kBlockK;
            if constexpr (kCluster > 1) {  // this CTA's share of the rows, into every CTA of the cluster
              if (share_live)
                SM90_TMA_LOAD_MULTICAST_2D::copy(&p.tma_a, &s.full[stage], (1u << kCluster) - 1, 0,
                                                 a_stage + cta * kShareRows * kBlockK, kb * kBlockK,
                                                 tile.m0 + cta * kShareRows);
            } else {
              SM90_TMA_LOAD_2D::copy(&p.tma_a, &s.full[stage], 0, a_stage, kb * kBlockK, tile.m0);
              if (a_rows == kBlockM)
                SM90_TMA_LOAD_2D::copy(&p.tma_a, &s.full[stage], 0, a_stage + 64 * kBlockK, kb * kBlockK,
                                       tile.m0 + 64);
            }
            if constexpr (kMx) {
              SM90_TMA_LOAD_2D::copy(&p.tma_b, &s.full[stage], 0, s.packed.data() + stage * kBlockN * kBlockK / 2,
                                     kb * kBlockK / 2, b_row);
              // the shifts of this 128-row block's K block: 512 contiguous bytes
              const uint8_t* shifts = p.b_shifts + ((size_t(b_row) / kBlockN) * KB + kb) * (kBlockN * 4);
              SM90_BULK_COPY_G2S::copy(shifts, &s.full[stage], s.shifts.data() + stage * kBlockN * 4, kBlockN * 4);
            } else {
              SM90_TMA_LOAD_2D::copy(&p.tma_b, &s.full[stage], 0, s.b.data() + stage * kBlockN * kBlockK,
                                     kb * kBlockK, b_row);
            }
            if (++stage == kStages) {
              stage = 0;
              phase ^= 1;
            }
          }
        }
      }
    }
  } else if constexpr (kStaged) {
    math_staged<kSwiGLU, kCluster, kStagger, kDeferred, kMx>(p, s, first_unit, unit_stride, total_units,
                                                             units_per_tile);
  } else {
    math<kSwiGLU, kCluster>(p, s, first_unit, unit_stride, total_units, units_per_tile);
  }
  if constexpr (kCluster > 1) {  // no CTA leaves while a peer may still arrive on its barriers
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  }
}

// Releases a consumed stage to every CTA whose loads write it.
template <int kCluster>
__device__ __forceinline__ void release(uint64_t* empty, int lane) {
  if (lane == 0) {
    if constexpr (kCluster > 1) {
#pragma unroll
      for (int c = 0; c < kCluster; ++c) cutlass::arch::ClusterBarrier::arrive(empty, c, 1);
    } else {
      cutlass::arch::ClusterBarrier::arrive(empty);
    }
  }
}

// Once the stage's loads have landed: one 128-deep K block's wgmmas into scratch (overwritten),
// committed as one batch, not waited for; none where the warpgroup's rows are dead (skip_dead).
template <class Mma, class FragA, class FragB, class Accum>
__device__ __forceinline__ void issue_k_block(Mma& mma, FragA& tCrA, FragB& tCrB, Accum& scratch, uint64_t* full,
                                              uint32_t phase, int stage, bool dead = false) {
  cutlass::arch::ClusterTransactionBarrier::wait(full, phase);
  if (dead) return;
  warpgroup_fence_operand(scratch);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), scratch);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// The first schedule (no kStaged): each block's K loop, then its epilogue stored straight from
// the fragments, with no wgmma in flight.
template <bool kSwiGLU, int kCluster>
__device__ void math(const Params& p, SharedStorage<0>& s, int first_unit, int unit_stride, int total_units,
                     int units_per_tile) {
  using Storage = SharedStorage<0>;
  constexpr int kStages = Storage::kStages;
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int lane = threadIdx.x % 32, G = p.num_groups, KB = p.k / kBlockK;
  const int ct = threadIdx.x - 128;
  TiledMma mma;
  auto thr = mma.get_thread_slice(ct);
  Tensor sA = make_tensor(make_smem_ptr(s.a.data()), typename Storage::LayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b.data()), typename Storage::LayoutB{});
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage) descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor scratch = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
  constexpr int kFrag = decltype(size(scratch))::value;  // 64: (2 columns, 2 rows, 16 column groups)
  static_assert(kFrag == 64, "m64n128 accumulator per thread");
  float acc[kFrag];
  uint32_t gate[kFrag / 2];  // SwiGLU: the gate block as packed bf16

  // this thread's rows and columns in the tile (wgmma's accumulator layout)
  const int tile_row = (ct / 128) * 64 + ((ct % 128) / 32) * 16 + lane / 4;  // and + 8
  const int tile_col = 2 * (lane % 4);                                       // + 8 i, and + 1
  const int NB = p.n / kBlockN;
  int stage = 0;
  uint32_t phase = 0;

  for (int unit = first_unit; unit < total_units; unit += unit_stride) {
    Tile tile = decode(s, G, units_per_tile, unit);
    const int rows[2] = {tile.m0 + tile_row, tile.m0 + tile_row + 8};
    const int scale_rows[2] = {min(rows[0], p.pool_rows - 1), min(rows[1], p.pool_rows - 1)};
    const bool live[2] = {rows[0] < tile.m_end, rows[1] < tile.m_end};
    const int col0 = kSwiGLU ? gate_row(tile.block, p.chunk) : tile.block * kBlockN;

#pragma unroll 1
    for (int half = 0; half < (kSwiGLU ? 2 : 1); ++half) {
      const int out_col = col0 + half * p.chunk;
      const float* b_scale = p.b_scales + (size_t(tile.group) * NB + out_col / kBlockN) * KB;
      const float* a_scale0 = p.a_scales + size_t(scale_rows[0]) * KB;
      const float* a_scale1 = p.a_scales + size_t(scale_rows[1]) * KB;
#pragma unroll
      for (int v = 0; v < kFrag; ++v) acc[v] = 0.0f;

#pragma unroll 1
      for (int kb = 0; kb < KB; ++kb) {
        const float sb = __ldg(b_scale + kb);
        const float s0 = __ldg(a_scale0 + kb) * sb, s1 = __ldg(a_scale1 + kb) * sb;
        issue_k_block(mma, tCrA, tCrB, scratch, &s.full[stage], phase, stage);
        warpgroup_wait<0>();
        warpgroup_fence_operand(scratch);
        release<kCluster>(&s.empty[stage], lane);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
#pragma unroll
        for (int v = 0; v < kFrag; ++v) acc[v] = fmaf(scratch(v), (v & 2) ? s1 : s0, acc[v]);
      }

      // store this block (bf16): value v is row + 8 ((v >> 1) & 1), column 8 (v >> 2) + (v & 1)
#pragma unroll
      for (int i = 0; i < kFrag / 4; ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          uint32_t packed = pack_bf16(acc[4 * i + 2 * r], acc[4 * i + 2 * r + 1]);
          if (kSwiGLU && half == 0) gate[2 * i + r] = packed;
          if (live[r]) {
            *reinterpret_cast<uint32_t*>(p.out + size_t(rows[r]) * p.n + out_col + 8 * i + tile_col) = packed;
          }
          if (kSwiGLU && half == 1) {  // from here on acc holds the activation (fp32)
            float2 a = swiglu_pair(p, gate[2 * i + r], packed, live[r] ? __ldg(p.row_weights + rows[r]) : 0.0f);
            acc[4 * i + 2 * r] = a.x;
            acc[4 * i + 2 * r + 1] = a.y;
          }
        }
      }
    }

    if constexpr (kSwiGLU) {
      // one 1x128 scale block per row: this thread's 32 columns, then the quad's
      const int I = p.n / 2, act_col = tile.block * kBlockN + tile_col;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float scale = row_scale(acc, r);
        float recip = __frcp_rn(scale);
        if (!live[r]) continue;
        uint8_t* act_row = p.act + size_t(rows[r]) * I + act_col;
#pragma unroll
        for (int i = 0; i < kFrag / 4; ++i) {
          __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(
              make_float2(e4m3_quotient(acc[4 * i + 2 * r], scale, recip),
                          e4m3_quotient(acc[4 * i + 2 * r + 1], scale, recip)),
              __NV_SATFINITE, __NV_E4M3);
          *reinterpret_cast<__nv_fp8x2_storage_t*>(act_row + 8 * i) = q;
        }
        if (lane % 4 == 0) p.act_scales[size_t(rows[r]) * (I / kBlockN) + tile.block] = scale;
      }
    }
  }
}

// The staged schedule: one stream of K blocks over this CTA's output blocks (a SwiGLU unit is two:
// its gate block, then its up block). Step i issues its wgmmas into the scratch accumulator, then
// (at a block's first K block) runs the previous block's epilogue from `acc` while they execute,
// then promotes scratch into acc. The wgmmas are issued on every step, outside any branch.
// kStagger: warpgroup 1 starts once warpgroup 0's first K block is done. Both issue into the same
// tensor cores, and issued at once their wgmmas interleave, end together, and leave the tensor
// cores idle while both promote; a K block apart, each one's wgmmas queue behind the other's and
// run while the other promotes, which keeps them apart.
template <bool kSwiGLU, int kCluster, bool kStagger, bool kDeferred, bool kMx>
__device__ void math_staged(const Params& p, SharedStorage<staging_buffers(true, kDeferred), kMx>& s,
                            int first_unit, int unit_stride, int total_units, int units_per_tile) {
  using Storage = SharedStorage<staging_buffers(true, kDeferred), kMx>;
  static_assert(kSwiGLU || !kDeferred, "only the SwiGLU epilogue is deferred");
  constexpr int kStages = Storage::kStages;
  constexpr int kHalves = kSwiGLU ? 2 : 1;
  cutlass::arch::warpgroup_reg_alloc<kMx ? 224 : 232>();
  const int lane = threadIdx.x % 32, G = p.num_groups, KB = p.k / kBlockK;
  const int ct = threadIdx.x - 128, wg = ct / 128, wt = ct % 128;
  TiledMma mma;
  auto thr = mma.get_thread_slice(ct);
  Tensor sA = make_tensor(make_smem_ptr(s.a.data()), typename Storage::LayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b.data()), typename Storage::LayoutB{});
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage) descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor scratch = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
  constexpr int kFrag = decltype(size(scratch))::value;  // 64: (2 columns, 2 rows, 16 column groups)
  static_assert(kFrag == 64, "m64n128 accumulator per thread");
  float acc[kFrag];

  // this thread's rows in its warpgroup's 64 (wgmma's accumulator layout: and + 8), and the byte
  // offset of its fragment in the staging buffer: value v is row + 8 ((v >> 1) & 1), column
  // 8 (v >> 2) + 2 (lane % 4) + (v & 1)
  const int frag_row = (wt / 32) * 16 + lane / 4;
  const int tile_row = wg * 64 + frag_row;
  uint8_t* staging = s.staging.data() + (kDeferred ? 2 : 1) * wg * 64 * kStagingPitch;
  const int frag_offset = frag_row * kStagingPitch + 4 * (lane % 4);
  const int NB = p.n / kBlockN, I = p.n / 2;

  const int my_units = first_unit < total_units ? (total_units - 1 - first_unit) / unit_stride + 1 : 0;
  const int steps = my_units * kHalves * KB;
  // the block being accumulated (started by step 0) and the finished one awaiting its epilogue
  int unit = first_unit - unit_stride, half = kHalves - 1, kb = KB - 1;
  Tile tile{0, 0, 0, 0}, done{0, 0, 0, 0};
  int out_col = 0, done_col = 0;
  const float *b_scale = p.b_scales, *a_scale0 = p.a_scales, *a_scale1 = p.a_scales;
  int stage = 0;
  uint32_t phase = 0;
#pragma unroll
  for (int v = 0; v < kFrag; ++v) acc[v] = 0.0f;

  // A finished block's epilogue from acc: bf16 rows through the staging buffer; for an up block,
  // SwiGLU with the gate block this thread staged before, then the e4m3 activation block.
  auto epilogue = [&](const Tile& t, int col, bool up) {
    const int row0 = t.m0 + wg * 64;
    const int rows[2] = {t.m0 + tile_row, t.m0 + tile_row + 8};
    const bool live[2] = {rows[0] < t.m_end, rows[1] < t.m_end};
    float w[2] = {0.0f, 0.0f};
    if (kSwiGLU && up) {
      w[0] = live[0] ? __ldg(p.row_weights + rows[0]) : 0.0f;
      w[1] = live[1] ? __ldg(p.row_weights + rows[1]) : 0.0f;
    }
    warpgroup_sync(wg);  // the previous copy-out has read the buffer
#pragma unroll
    for (int i = 0; i < kFrag / 4; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        uint32_t* slot = reinterpret_cast<uint32_t*>(staging + frag_offset + 8 * r * kStagingPitch + 16 * i);
        uint32_t packed = pack_bf16(acc[4 * i + 2 * r], acc[4 * i + 2 * r + 1]);
        if (kSwiGLU && up) {  // the gate this thread staged for the unit's first block; acc becomes the activation
          float2 a = swiglu_pair(p, *slot, packed, w[r]);
          acc[4 * i + 2 * r] = a.x;
          acc[4 * i + 2 * r + 1] = a.y;
        }
        *slot = packed;
      }
    }
    warpgroup_sync(wg);
    copy_out<2 * kBlockN / 16>(staging, reinterpret_cast<uint8_t*>(p.out + col), size_t(p.n) * 2, row0, t.m_end, wt);
    if constexpr (kSwiGLU) {
      if (up) {  // one 1x128 scale block per row: this thread's 32 columns, then the quad's
        float scale[2], recip[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          scale[r] = row_scale(acc, r);
          recip[r] = __frcp_rn(scale[r]);
        }
        warpgroup_sync(wg);  // the pre-activations are out of the buffer
#pragma unroll
        for (int i = 0; i < kFrag / 4; ++i) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(
                make_float2(e4m3_quotient(acc[4 * i + 2 * r], scale[r], recip[r]),
                            e4m3_quotient(acc[4 * i + 2 * r + 1], scale[r], recip[r])),
                __NV_SATFINITE, __NV_E4M3);
            // e4m3 columns: half the bf16 byte offset
            *reinterpret_cast<__nv_fp8x2_storage_t*>(staging + frag_row * kStagingPitch + 8 * r * kStagingPitch +
                                                     2 * (lane % 4) + 8 * i) = q;
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (live[r] && lane % 4 == 0) p.act_scales[size_t(rows[r]) * (I / kBlockN) + t.block] = scale[r];
        }
        warpgroup_sync(wg);
        copy_out<kBlockN / 16>(staging, p.act + t.block * kBlockN, size_t(I), row0, t.m_end, wt);
      }
    }
    // the next block's promotions add into zeros (a select in every step's promotion instead
    // cost ~130 instructions a step: the selects and the register moves they caused)
#pragma unroll
    for (int v = 0; v < kFrag; ++v) acc[v] = 0.0f;
  };

  // kDeferred: a unit's epilogue runs after its up block, from the staged bf16 block, in kPasses
  // passes of 8 rows, 16 threads a row and 8 columns each: the pre-activations copied out,
  // SwiGLU, the row's amax by 4 shuffles, the e4m3 block. A pass needs ~30 registers beside the
  // two accumulators, so it runs under the next unit's gate-block wgmmas, one step in two where
  // that block has at least 16 steps; what is left when it ends runs then, before that block is
  // staged. The gate block waits in a second staging buffer (4 stages fit beside the two).
  constexpr int kPasses = 8;
  uint8_t* const staged_up = staging + 64 * kStagingPitch;
  const int pass_row = wt / 16, pass_col = 8 * (wt % 16);
  int pass = kPasses;                     // the pending unit's next pass (kPasses: none pending)
  int pend_row0 = 0, pend_end = 0;        // its first row in this warpgroup and its group's end
  int pend_col = 0, pend_block = 0;       // its gate block's output column and its activation block
  float pend_w = 0.0f;                    // the next pass's row weight, loaded a pass ahead
  const bool pass_every_step = KB < 2 * kPasses;

  // acc (a finished block) -> bf16 into a staging buffer in the fragments' layout; acc is zeroed
  auto stage_block = [&](uint8_t* buffer) {
#pragma unroll
    for (int i = 0; i < kFrag / 4; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        *reinterpret_cast<uint32_t*>(buffer + frag_offset + 8 * r * kStagingPitch + 16 * i) =
            pack_bf16(acc[4 * i + 2 * r], acc[4 * i + 2 * r + 1]);
        acc[4 * i + 2 * r] = 0.0f;
        acc[4 * i + 2 * r + 1] = 0.0f;
      }
    }
  };
  auto load_pass_weight = [&]() {
    const int row = pend_row0 + 8 * pass + pass_row;
    pend_w = row < pend_end ? __ldg(p.row_weights + row) : 0.0f;
  };
  auto swiglu_pass = [&]() {
    const int lr = 8 * pass + pass_row, row = pend_row0 + lr;
    const bool live = row < pend_end;
    const float w = pend_w;
    if (++pass < kPasses) load_pass_weight();
    const uint4 g = *reinterpret_cast<const uint4*>(staging + lr * kStagingPitch + 2 * pass_col);
    const uint4 u = *reinterpret_cast<const uint4*>(staged_up + lr * kStagingPitch + 2 * pass_col);
    __nv_bfloat16* out_row = p.out + size_t(row) * p.n + pend_col + pass_col;
    if (live) {
      *reinterpret_cast<uint4*>(out_row) = g;
      *reinterpret_cast<uint4*>(out_row + p.chunk) = u;
    }
    float2 a[4] = {swiglu_pair(p, g.x, u.x, w), swiglu_pair(p, g.y, u.y, w), swiglu_pair(p, g.z, u.z, w),
                   swiglu_pair(p, g.w, u.w, w)};
    uint32_t amax_bits = 0;  // as row_scale: a NaN's bits exceed every finite value's
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      amax_bits = max(amax_bits, __float_as_uint(a[j].x) & 0x7fffffffu);
      amax_bits = max(amax_bits, __float_as_uint(a[j].y) & 0x7fffffffu);
    }
#pragma unroll
    for (int off = 1; off < 16; off <<= 1) amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, off));
    const float amax = __uint_as_float(amax_bits);
    const float scale = __fdiv_rn(amax != amax ? amax : fmaxf(amax, 1e-4f), 448.0f);
    const float recip = __frcp_rn(scale);
    if (live) {
      uint32_t q[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
            make_float2(e4m3_quotient(a[2 * j].x, scale, recip), e4m3_quotient(a[2 * j].y, scale, recip)),
            __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
            make_float2(e4m3_quotient(a[2 * j + 1].x, scale, recip), e4m3_quotient(a[2 * j + 1].y, scale, recip)),
            __NV_SATFINITE, __NV_E4M3);
        q[j] = uint32_t(lo) | (uint32_t(hi) << 16);
      }
      *reinterpret_cast<uint2*>(p.act + size_t(row) * I + pend_block * kBlockN + pass_col) = make_uint2(q[0], q[1]);
      if (wt % 16 == 0) p.act_scales[size_t(row) * (I / kBlockN) + pend_block] = scale;
    }
  };
  // a finished up block: staged beside its gate block, and its unit's passes pending
  auto stage_up_block = [&](const Tile& t, int up_col) {
    stage_block(staged_up);
    warpgroup_sync(wg);  // both blocks staged for every thread's passes
    pend_row0 = t.m0 + wg * 64;
    pend_end = t.m_end;
    pend_col = up_col - p.chunk;
    pend_block = t.block;
    pass = 0;
    load_pass_weight();
  };
  // a finished gate block: the previous unit's passes done first (they read the buffers)
  auto stage_gate_block = [&]() {
    while (pass < kPasses) swiglu_pass();
    warpgroup_sync(wg);
    stage_block(staging);
  };

  // math_expand: this thread's share of each stage's expansion, `kAhead` steps before its use (the
  // first kAhead before the stagger's wait: the warpgroup ahead needs the other's shares of them)
  constexpr int kAhead = 2;
  int x_step = 0, x_stage = 0;
  uint32_t x_phase = 0;
  auto expand_next = [&]() {
    convert_stage<kSharedExpandThreads>(s, x_stage, x_phase, kExpandThreads + ct);
    if (++x_stage == kStages) {
      x_stage = 0;
      x_phase ^= 1;
    }
    ++x_step;
  };
  if constexpr (kMx) {
    if (p.math_expand)
      while (x_step < min(kAhead, steps)) expand_next();
  }

  if (kStagger && wg == 1 && steps > 0) asm volatile("bar.sync 3, 256;" ::: "memory");

#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    if (++kb == KB) {  // a new block: the one accumulated so far waits for its epilogue
      kb = 0;
      done = tile;
      done_col = out_col;
      if (++half == kHalves) {
        half = 0;
        unit += unit_stride;
        tile = decode(s, G, units_per_tile, unit);
      }
      out_col = (kSwiGLU ? gate_row(tile.block, p.chunk) : tile.block * kBlockN) + half * p.chunk;
      b_scale = p.b_scales + (size_t(tile.group) * NB + out_col / kBlockN) * KB;
      a_scale0 = p.a_scales + size_t(min(tile.m0 + tile_row, p.pool_rows - 1)) * KB;
      a_scale1 = p.a_scales + size_t(min(tile.m0 + tile_row + 8, p.pool_rows - 1)) * KB;
    }
    const bool block_done = kb == 0 && step > 0;
    // (not deferred) an up block's epilogue (SwiGLU, the requantization) needs more registers
    // than fit beside a wgmma in flight, so it runs first; plain and gate blocks run under the wgmmas
    if (!kDeferred && kSwiGLU && block_done && half == 0) epilogue(done, done_col, true);
    const float sb = __ldg(b_scale + kb);
    const float s0 = __ldg(a_scale0 + kb) * sb, s1 = __ldg(a_scale1 + kb) * sb;
    // dead: this warpgroup's 64 rows of the tile all past its group's end (uniform over the
    // warpgroup; from the tile's live registers, not one more held across the step). Not with
    // the in-place SwiGLU epilogue: the branch makes it spill (72 bytes against 4).
    issue_k_block(mma, tCrA, tCrB, scratch, s.ready(stage), phase, stage,
                  (kDeferred || !kSwiGLU) && p.skip_dead && tile.m0 + wg * 64 >= tile.m_end);
    if constexpr (kMx) {  // under this step's wgmmas: the share of step + kAhead
      if (p.math_expand && x_step < steps) expand_next();
    }
    if constexpr (kDeferred) {
      if (block_done) {
        if (half == 0) stage_up_block(done, done_col);
        else stage_gate_block();
      }
      if (pass < kPasses && (pass_every_step || (kb & 1))) swiglu_pass();
    } else if (block_done && !(kSwiGLU && half == 0)) {
      epilogue(done, done_col, false);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(scratch);
    if (kStagger && wg == 0 && step == 0) asm volatile("bar.arrive 3, 256;" ::: "memory");
    release<kCluster>(&s.empty[stage], lane);
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
#pragma unroll
    for (int v = 0; v < kFrag; ++v) acc[v] = fmaf(scratch(v), (v & 2) ? s1 : s0, acc[v]);
  }
  if (steps > 0) {
    if constexpr (kDeferred) {
      stage_up_block(tile, out_col);
      while (pass < kPasses) swiglu_pass();
    } else {
      epilogue(tile, out_col, kSwiGLU);
    }
  }
}

// Four E2M1 codes (a 16-bit half of a packed word, element i in nibble i) -> four e4m3 bytes
// through the shift's table (lo: magnitudes 0-3, hi: 4-7): one permute picks each magnitude's
// byte, another puts 0x80 where the code's sign bit (nibble bit 3) is set.
__device__ __forceinline__ uint32_t expand4(uint32_t codes, uint32_t lo, uint32_t hi) {
  const uint32_t magnitude = __byte_perm(lo, hi, codes & 0x7777u);
  const uint32_t sign = __byte_perm(0u, 0x80808080u, (codes >> 1) & 0x4444u);  // index 4 or 0
  return magnitude | sign;
}

// kMx: one stage's packed B rows expanded into its e4m3 tile, the share of converter `tid` of
// kConverters. A task is one row's 1x32 block j: 16 packed bytes (a warp reads 512 contiguous bytes)
// -> 32 e4m3 bytes, 16-byte chunks 2j and 2j + 1 of the row, each at chunk ^ (row % 8) as the
// 128-byte swizzle places it (a quarter warp's 8 stores fall into 8 distinct chunks). Converter t
// takes tasks t + kConverters i: the same block j of rows r0 + kConverters / 4 i, and as that step
// is a multiple of 8, the same swizzled chunks in every one of them (512 tasks: 96 converters take
// 5 or 6, 352 take 1 or 2).
template <int kConverters, class Storage>
__device__ __forceinline__ void expand_share(Storage& s, int stage, int tid) {
  static_assert(kConverters % 32 == 0 && (kConverters / 4) % 8 == 0, "fixed chunks per converter");
  constexpr int kRowStep = kConverters / 4;
  const int j = tid & 3, r0 = tid >> 2;
  const int tasks = (kBlockN * 4 - tid + kConverters - 1) / kConverters;
  const uint8_t* packed = s.packed.data() + stage * kBlockN * kBlockK / 2 + r0 * (kBlockK / 2) + 16 * j;
  const uint8_t* shifts = s.shifts.data() + stage * kBlockN * 4 + tid;  // row * 4 + j
  uint8_t* b = reinterpret_cast<uint8_t*>(s.b.data() + stage * kBlockN * kBlockK);
  const int out_first = r0 * kBlockK + (((2 * j) ^ (r0 & 7)) << 4);
  const int out_second = r0 * kBlockK + (((2 * j + 1) ^ (r0 & 7)) << 4);
#pragma unroll 2
  for (int i = 0; i < tasks; ++i) {
    const uint4 q = *reinterpret_cast<const uint4*>(packed + i * kRowStep * (kBlockK / 2));
    const int shift = shifts[i * kConverters];
    const uint32_t lo = s.lut[2 * shift], hi = s.lut[2 * shift + 1];
    const uint4 first = make_uint4(expand4(q.x, lo, hi), expand4(q.x >> 16, lo, hi), expand4(q.y, lo, hi),
                                   expand4(q.y >> 16, lo, hi));
    const uint4 second = make_uint4(expand4(q.z, lo, hi), expand4(q.z >> 16, lo, hi), expand4(q.w, lo, hi),
                                    expand4(q.w >> 16, lo, hi));
    *reinterpret_cast<uint4*>(b + out_first + i * kRowStep * kBlockK) = first;
    *reinterpret_cast<uint4*>(b + out_second + i * kRowStep * kBlockK) = second;
  }
}

// A converter's part of one stage: once its loads have landed, its share of the expansion, then
// its arrival on the stage's `converted` barrier, which the math warpgroups wait on.
template <int kConverters, class Storage>
__device__ __forceinline__ void convert_stage(Storage& s, int stage, uint32_t phase, int tid) {
  cutlass::arch::ClusterTransactionBarrier::wait(&s.full[stage], phase);
  expand_share<kConverters>(s, stage, tid);
  cutlass::arch::fence_view_async_shared();  // the generic-proxy stores, before wgmma reads them
  cutlass::arch::ClusterBarrier::arrive(&s.converted[stage]);
}

// kMx, warps 1-3 of the producer warpgroup: for each stage this CTA consumes, in the producer's
// order, their share of its expansion (all of it, or with math_expand 96 of 352 converters'). The
// math warpgroups' release of a stage follows its expansion (they wait for it), so the producer
// refills the packed rows only once they are read.
template <class Storage>
__device__ void expand_e2m1(Storage& s, int steps, int converters) {
  constexpr int kStages = Storage::kStages;
  const int t = threadIdx.x - 32;
  int stage = 0;
  uint32_t phase = 0;
#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    if (converters == kExpandThreads) convert_stage<kExpandThreads>(s, stage, phase, t);
    else convert_stage<kSharedExpandThreads>(s, stage, phase, t);
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
}

}  // namespace expert_sm90
}  // namespace megamoe
