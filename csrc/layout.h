// Symmetric buffer layout: the size and byte offset of every region for one config and
// group size. Every rank's buffer has the identical layout, so a peer's region is found at
// the same offset in the peer's mapping. The buffer holds only what peers read or write;
// everything an owner computes for itself (pools, plans) is ordinary memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace megamoe {

struct LayoutSpec {
  int64_t num_ranks;
  int64_t max_tokens;        // num_max_tokens_per_rank
  int64_t hidden;
  int64_t topk;
  std::string act_dtype;     // storage dtype of dispatched activations
  int64_t act_itemsize;
  int64_t act_block;         // scale block along the row; 0 = unscaled (native recipe)
  std::string scale_dtype;
  int64_t scale_itemsize;
  std::string compute_dtype; // dtype of combine partials and of gradients travelling back
  int64_t compute_itemsize;
  int64_t shared_experts;    // 1: one extra partial row per token for the shared experts
};

struct Region {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t offset;  // bytes from the start of the buffer, a multiple of kRegionAlign
  int64_t nbytes;
};

constexpr int64_t kRegionAlign = 256;

std::vector<Region> buffer_layout(const LayoutSpec& spec);

}  // namespace megamoe
