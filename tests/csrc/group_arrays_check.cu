// Host-side check of the per-group argument arrays that csrc/cuda/grouped_gemm_impl.cuh builds
// for CUTLASS, for a row-grouped (forward) and a depth-grouped (wgrad) fp8 GEMM and the bf16
// depth-grouped GEMM accumulating into fp32 (gradient-accumulation fusion): problem shapes,
// pointers, strides, and the scale layouts read through the same local_tile view the blockwise
// main loop takes. Needs no GPU (fill_group_entry is a host function too); compiled and run by
// tests/test_cutlass_host.py. Prints each failure and exits nonzero if any.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "grouped_gemm_impl.cuh"

using namespace cute;
using megamoe::detail::GroupedDim;
using megamoe::detail::GroupedGemm;
using megamoe::detail::kScaleBlock;

namespace {

int failures = 0;

#define EXPECT(cond, ...)                                 \
  do {                                                    \
    if (!(cond)) {                                        \
      ++failures;                                         \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                           \
      std::printf("\n");                                  \
    }                                                     \
  } while (0)

using E4M3 = cutlass::float_e4m3_t;
using NK = cutlass::layout::ColumnMajor;
using Tile = Shape<_128, _128, _128>;
using Cluster = Shape<_1, _2, _1>;
using RowGrouped = GroupedGemm<E4M3, NK, Tile, Cluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
using DepthGrouped = GroupedGemm<E4M3, NK, Tile, Cluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, GroupedDim::kDepth>;

using BF16 = cutlass::bfloat16_t;
using AccGrouped = GroupedGemm<BF16, cutlass::layout::RowMajor, Shape<_128, _128, _64>, Cluster,
                               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, GroupedDim::kDepth,
                               cutlass::layout::ColumnMajor, float,
                               cutlass::epilogue::collective::EpilogueTileAuto, /*kAccumulate=*/true>;

template <class G>
struct HostArrays {
  std::vector<char> storage;
  typename G::GroupArrays arr;
  explicit HostArrays(int groups) {
    size_t used = 0;
    G::carve(nullptr, groups, &used);
    storage.resize(used + megamoe::detail::kAlign);
    char* base = storage.data();
    base += (megamoe::detail::kAlign - reinterpret_cast<uintptr_t>(base) % megamoe::detail::kAlign) % megamoe::detail::kAlign;
    arr = G::carve(base, groups);
  }
};

// The scale tensor of group g as the main loop sees it: (BLK_M or BLK_N, BLK_K, tiles, k tiles, l).
template <class Layout>
auto scale_tiles(const float* ptr, Layout layout, bool a_operand) {
  Tensor full = make_tensor(make_gmem_ptr(ptr), layout);
  if (a_operand) return local_tile(full, Tile{}, make_coord(_, _, _), Step<_1, Underscore, _1>{});
  return local_tile(full, Tile{}, make_coord(_, _, _), Step<Underscore, _1, _1>{});
}

// Every 1x128 scale of a group's rows [0, rows) and K blocks [0, depth/128) sits at
// base + row * row_stride + K block, seen through the main loop's tiles of 128 x 128.
template <class Layout>
void check_row_scales(const char* what, int g, const float* ptr, Layout layout, bool a_operand, int rows, int depth,
                      const float* base, int64_t row_stride, int row_block) {
  auto tiles = scale_tiles(ptr, layout, a_operand);
  for (int r = 0; r < rows; r += 37) {
    for (int kk = 0; kk < depth; kk += kScaleBlock) {
      const float* got = &tiles(r % 128, kk % 128, r / 128, kk / 128, 0);
      const float* want = base + (r / row_block) * row_stride + kk / kScaleBlock;
      EXPECT(got == want, "%s group %d row %d k %d: offset %ld, want %ld", what, g, r, kk, long(got - base),
             long(want - base));
    }
  }
}

// A depth-grouped group's problem shape: no tiles when it has no rows, else (m, n, depth).
// Returns whether the group has tiles (then its pointers and strides are worth checking).
template <class GroupShape>
bool check_depth_shape(int g, GroupShape shape, int m, int n, int depth) {
  if (depth == 0) {
    EXPECT(get<0>(shape) == 0, "empty group %d must have no tiles (M = %d)", g, int(get<0>(shape)));
    return false;
  }
  EXPECT(get<0>(shape) == m && get<1>(shape) == n && get<2>(shape) == depth, "group %d shape (%d, %d, %d)", g,
         int(get<0>(shape)), int(get<1>(shape)), int(get<2>(shape)));
  return true;
}

void check_depth_grouped() {
  const int m = 256, n = 384, p = 1664, kb = p / kScaleBlock;
  // skewed groups, two empty ones, one of exactly 128 rows, a tail past the last end (1408..1664)
  std::vector<int32_t> ends = {384, 384, 512, 1024, 1280, 1280, 1408};
  int groups = static_cast<int>(ends.size());
  std::vector<uint8_t> a(size_t(m) * p), b(size_t(n) * p);
  std::vector<float> sfa(size_t(m) * kb), sfb(size_t(n) * kb);
  std::vector<uint16_t> d(size_t(groups) * m * n);
  HostArrays<DepthGrouped> host(groups);
  auto& arr = host.arr;
  for (int g = 0; g < groups; ++g) {
    megamoe::detail::fill_group_entry<DepthGrouped>(arr, ends.data(), g, m, n, p, a.data(), sfa.data(), b.data(),
                                                    sfb.data(), d.data());
  }
  for (int g = 0; g < groups; ++g) {
    int start = g == 0 ? 0 : ends[g - 1], depth = ends[g] - start;
    if (!check_depth_shape(g, arr.shapes[g], m, n, depth)) continue;
    EXPECT(reinterpret_cast<const uint8_t*>(arr.a[g]) == a.data() + start, "group %d A pointer", g);
    EXPECT(reinterpret_cast<const uint8_t*>(arr.b[g]) == b.data() + start, "group %d B pointer", g);
    EXPECT(reinterpret_cast<uint16_t*>(arr.d[g]) == d.data() + size_t(g) * m * n, "group %d D pointer", g);
    EXPECT(get<0>(arr.stride_a[g]) == p, "group %d A row stride %ld", g, long(get<0>(arr.stride_a[g])));
    EXPECT(get<0>(arr.stride_b[g]) == p, "group %d B row stride %ld", g, long(get<0>(arr.stride_b[g])));
    EXPECT(get<0>(arr.stride_d[g]) == n, "group %d D row stride %ld", g, long(get<0>(arr.stride_d[g])));
    EXPECT(arr.sfa[g] == sfa.data() + start / kScaleBlock, "group %d A scale pointer", g);
    EXPECT(arr.sfb[g] == sfb.data() + start / kScaleBlock, "group %d B scale pointer", g);
    EXPECT(size(arr.layout_sfa[g]) == size_t(m) * depth, "group %d A scale layout size %d", g, int(size(arr.layout_sfa[g])));
    check_row_scales("A scales", g, arr.sfa[g], arr.layout_sfa[g], true, m, depth, sfa.data() + start / kScaleBlock, kb, 1);
    check_row_scales("B scales", g, arr.sfb[g], arr.layout_sfb[g], false, n, depth, sfb.data() + start / kScaleBlock, kb, 1);
  }
  // ranges that are not whole 128-row blocks inside the pool are skipped (and get NaN)
  std::vector<int32_t> bad = {128, 100, 256, 1920};
  for (int g = 0; g < static_cast<int>(bad.size()); ++g) {
    megamoe::detail::fill_group_entry<DepthGrouped>(arr, bad.data(), g, m, n, p, a.data(), sfa.data(), b.data(),
                                                    sfb.data(), d.data());
    bool valid = megamoe::detail::depth_range_valid(g == 0 ? 0 : bad[g - 1], bad[g], p);
    EXPECT(valid == (g == 0), "bad range %d judged %s", g, valid ? "valid" : "invalid");
    EXPECT((get<0>(arr.shapes[g]) == 0) == (g != 0), "bad range %d has M = %d", g, int(get<0>(arr.shapes[g])));
  }
  EXPECT(megamoe::detail::depth_range_valid(384, 384, p), "an empty group is a valid range");
  EXPECT(!megamoe::detail::depth_range_valid(256, 128, p), "a decreasing range is invalid");
}

// The accumulating bf16 wgrad: A and B are the pool itself ([P, M], [P, N]), so group g starts
// start rows in, with leading dimensions M and N; any row range inside the pool is usable (16-row
// groups); an empty group or a range outside the pool gets no tiles (its fp32 D is left alone).
void check_accumulating() {
  const int m = 256, n = 384, p = 1104;
  std::vector<int32_t> ends = {48, 48, 64, 576, 1040};
  int groups = static_cast<int>(ends.size());
  std::vector<uint16_t> a(size_t(p) * m), b(size_t(p) * n);
  std::vector<float> d(size_t(groups) * m * n);
  HostArrays<AccGrouped> host(groups);
  auto& arr = host.arr;
  for (int g = 0; g < groups; ++g) {
    megamoe::detail::fill_group_entry<AccGrouped>(arr, ends.data(), g, m, n, p, a.data(), nullptr, b.data(), nullptr,
                                                  d.data());
  }
  for (int g = 0; g < groups; ++g) {
    int start = g == 0 ? 0 : ends[g - 1], depth = ends[g] - start;
    if (!check_depth_shape(g, arr.shapes[g], m, n, depth)) continue;
    EXPECT(reinterpret_cast<const uint16_t*>(arr.a[g]) == a.data() + size_t(start) * m, "group %d A pointer", g);
    EXPECT(reinterpret_cast<const uint16_t*>(arr.b[g]) == b.data() + size_t(start) * n, "group %d B pointer", g);
    EXPECT(arr.d[g] == d.data() + size_t(g) * m * n, "group %d D pointer", g);
    EXPECT(get<1>(arr.stride_a[g]) == m, "group %d A: %ld elements per k, want M", g, long(get<1>(arr.stride_a[g])));
    EXPECT(get<1>(arr.stride_b[g]) == n, "group %d B: %ld elements per k, want N", g, long(get<1>(arr.stride_b[g])));
    EXPECT(get<0>(arr.stride_d[g]) == n, "group %d D row stride %ld", g, long(get<0>(arr.stride_d[g])));
  }
  std::vector<int32_t> bad = {64, 32, p + 16};  // decreasing, then past the pool: skipped
  for (int g = 0; g < static_cast<int>(bad.size()); ++g) {
    megamoe::detail::fill_group_entry<AccGrouped>(arr, bad.data(), g, m, n, p, a.data(), nullptr, b.data(), nullptr,
                                                  d.data());
    EXPECT((get<0>(arr.shapes[g]) == 0) == (g != 0), "bad range %d has M = %d", g, int(get<0>(arr.shapes[g])));
  }
}

void check_row_grouped() {
  const int n = 256, k = 512, kb = k / kScaleBlock;
  std::vector<int32_t> ends = {128, 128, 384};
  int groups = static_cast<int>(ends.size()), rows_total = 384;
  std::vector<uint8_t> a(size_t(rows_total) * k), b(size_t(groups) * n * k);
  std::vector<float> sfa(size_t(rows_total) * kb), sfb(size_t(groups) * (n / kScaleBlock) * kb);
  std::vector<uint16_t> d(size_t(rows_total) * n);
  HostArrays<RowGrouped> host(groups);
  auto& arr = host.arr;
  for (int g = 0; g < groups; ++g) {
    megamoe::detail::fill_group_entry<RowGrouped>(arr, ends.data(), g, 0, n, k, a.data(), sfa.data(), b.data(),
                                                  sfb.data(), d.data());
  }
  for (int g = 0; g < groups; ++g) {
    int start = g == 0 ? 0 : ends[g - 1], rows = ends[g] - start;
    auto shape = arr.shapes[g];
    EXPECT(get<0>(shape) == rows && get<1>(shape) == n && get<2>(shape) == k, "group %d shape", g);
    EXPECT(reinterpret_cast<const uint8_t*>(arr.a[g]) == a.data() + size_t(start) * k, "group %d A pointer", g);
    EXPECT(reinterpret_cast<const uint8_t*>(arr.b[g]) == b.data() + size_t(g) * n * k, "group %d B pointer", g);
    EXPECT(reinterpret_cast<uint16_t*>(arr.d[g]) == d.data() + size_t(start) * n, "group %d D pointer", g);
    EXPECT(get<0>(arr.stride_a[g]) == k && get<0>(arr.stride_b[g]) == k && get<0>(arr.stride_d[g]) == n,
           "group %d strides", g);
    EXPECT(arr.sfa[g] == sfa.data() + size_t(start) * kb, "group %d A scale pointer", g);
    EXPECT(arr.sfb[g] == sfb.data() + size_t(g) * (n / kScaleBlock) * kb, "group %d B scale pointer", g);
    if (rows > 0) {
      check_row_scales("A scales", g, arr.sfa[g], arr.layout_sfa[g], true, rows, k, sfa.data() + size_t(start) * kb, kb, 1);
    }
    check_row_scales("B scales", g, arr.sfb[g], arr.layout_sfb[g], false, n, k, arr.sfb[g], kb, kScaleBlock);
  }
}

}  // namespace

int main() {
  check_depth_grouped();
  check_row_grouped();
  check_accumulating();
  std::printf("%s (%d failures)\n", failures ? "FAILED" : "OK", failures);
  return failures ? 1 : 0;
}
