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

std::vector<Region> buffer_layout(const LayoutSpec& spec) {
  check_positive(spec.num_ranks, "num_ranks");
  check_positive(spec.max_tokens, "max_tokens");
  check_positive(spec.hidden, "hidden");
  check_positive(spec.topk, "topk");
  if (spec.act_block < 0 || (spec.act_block && spec.hidden % spec.act_block))
    throw std::invalid_argument("buffer_layout: act_block must divide hidden");
  if (spec.shared_experts != 0 && spec.shared_experts != 1)
    throw std::invalid_argument("buffer_layout: shared_experts must be 0 or 1");

  const int64_t R = spec.num_ranks, T = spec.max_tokens, H = spec.hidden, K = spec.topk;
  LayoutBuilder b;

  // Input verdict and call epoch of every source, double-buffered by call parity: a rank that
  // raised after a failed exchange may publish its next verdict before a slower peer read this one.
  b.add("status", "int32", 4, {2, R, 4});

  // Published by the home rank, pulled by the owners: one row per token, whatever its top-k.
  b.add("x", spec.act_dtype, spec.act_itemsize, {T, H});
  if (spec.act_block) b.add("x_scales", spec.scale_dtype, spec.scale_itemsize, {T, H / spec.act_block});
  b.add("topk_idx", "int32", 4, {T, K});
  b.add("topk_weights", "float32", 4, {T, K});
  b.add("grad_y", spec.compute_dtype, spec.compute_itemsize, {T, H});

  // Pushed by the owners into the home rank: one partial row per (owner rank, token), the
  // owner's experts already summed (plus the home's own shared-expert row), and d(topk weight).
  b.add("partials", spec.compute_dtype, spec.compute_itemsize, {R + spec.shared_experts, T, H});
  b.add("topk_weight_grads", "float32", 4, {T, K});
  return b.finish();
}

}  // namespace megamoe
