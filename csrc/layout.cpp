#include "layout.h"

#include <stdexcept>

namespace megamoe {

namespace {

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

class LayoutBuilder {
 public:
  void add(const std::string& name, const std::string& dtype, int64_t itemsize, std::vector<int64_t> shape) {
    int64_t numel = 1;
    for (int64_t dim : shape) {
      if (dim < 0) throw std::invalid_argument("buffer_layout: negative dimension in region " + name);
      numel *= dim;
    }
    Region region{name, dtype, std::move(shape), offset_, numel * itemsize};
    offset_ = round_up(offset_ + region.nbytes, kRegionAlign);
    regions_.push_back(std::move(region));
  }
  std::vector<Region> finish() { return std::move(regions_); }

 private:
  int64_t offset_ = 0;
  std::vector<Region> regions_;
};

void check_positive(int64_t value, const char* name) {
  if (value <= 0) throw std::invalid_argument(std::string("buffer_layout: ") + name + " must be positive");
}

}  // namespace

int64_t pool_rows(const LayoutSpec& spec) {
  int64_t routed = spec.num_ranks * spec.max_tokens * spec.topk;
  return round_up(routed, spec.block_m) + spec.num_local_experts * spec.block_m;
}

std::vector<Region> buffer_layout(const LayoutSpec& spec) {
  check_positive(spec.num_ranks, "num_ranks");
  check_positive(spec.num_local_experts, "num_local_experts");
  check_positive(spec.max_tokens, "max_tokens");
  check_positive(spec.hidden, "hidden");
  check_positive(spec.intermediate, "intermediate");
  check_positive(spec.topk, "topk");
  check_positive(spec.block_m, "block_m");
  check_positive(spec.num_combine_slots, "num_combine_slots");
  if (spec.act_block < 0 || (spec.act_block && (spec.hidden % spec.act_block || spec.intermediate % spec.act_block)))
    throw std::invalid_argument("buffer_layout: act_block must divide hidden and intermediate");

  const int64_t R = spec.num_ranks, E = spec.num_local_experts, T = spec.max_tokens;
  const int64_t H = spec.hidden, I = spec.intermediate, K = spec.topk;
  const int64_t P = pool_rows(spec);
  const bool scaled = spec.act_block > 0;
  LayoutBuilder b;

  // Workspace: small control data written by peers (names, counts) or read by kernels.
  // per-source input verdict, double-buffered by call parity: a rank that raised after a failed
  // exchange may publish its next verdict before a slower peer has read this one.
  b.add("status", "int32", 4, {2, R, 4});
  b.add("signals", "int32", 4, {2, R});                // device barrier flags, one per peer and phase parity
  b.add("recv_counts", "int32", 4, {R, E});            // [src rank, local expert] tokens announced by src
  b.add("recv_names", "int32", 4, {R, T * K});         // src's names (token*K+k), grouped by local expert
  b.add("arrival", "int32", 4, {P / spec.block_m});    // rows landed per pool block
  b.add("row_src", "int32", 4, {P});                   // per pool row: source rank (-1 = padding)
  b.add("row_name", "int32", 4, {P});                  // per pool row: token*K+k on the source rank

  // Inputs published by this rank for its peers to pull.
  b.add("x", spec.act_dtype, spec.act_itemsize, {T, H});
  if (scaled) b.add("x_scales", spec.scale_dtype, spec.scale_itemsize, {T, H / spec.act_block});
  b.add("topk_idx", "int32", 4, {T, K});
  b.add("topk_weights", "float32", 4, {T, K});
  b.add("grad_y", spec.compute_dtype, spec.compute_itemsize, {T, H});

  // Expert-major pools: L1 input, L2 input, per-row topk weight, pulled dY for backward.
  b.add("pool_x", spec.act_dtype, spec.act_itemsize, {P, H});
  if (scaled) b.add("pool_x_scales", spec.scale_dtype, spec.scale_itemsize, {P, H / spec.act_block});
  b.add("pool_act", spec.act_dtype, spec.act_itemsize, {P, I});
  if (scaled) b.add("pool_act_scales", spec.scale_dtype, spec.scale_itemsize, {P, I / spec.act_block});
  b.add("pool_weights", "float32", 4, {P});
  b.add("pool_grad", spec.compute_dtype, spec.compute_itemsize, {P, H});

  // Combine: rows pushed by expert owners to [slot, token]; d(topk weight) pushed back.
  b.add("combine", spec.compute_dtype, spec.compute_itemsize, {spec.num_combine_slots, T, H});
  b.add("combine_weight_grads", "float32", 4, {T, K});
  return b.finish();
}

}  // namespace megamoe
