// Symmetric buffer layout: the size and byte offset of every region for one config and
// group size. Every rank's buffer has the identical layout, so a peer's region is found at
// the same offset in the peer's mapping.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace megamoe {

struct LayoutSpec {
  int64_t num_ranks;
  int64_t num_local_experts;
  int64_t max_tokens;        // num_max_tokens_per_rank
  int64_t hidden;
  int64_t intermediate;
  int64_t topk;
  int64_t block_m;           // each expert's pool segment is padded to a multiple of this
  std::string act_dtype;     // storage dtype of dispatched / L2-input activations
  int64_t act_itemsize;
  int64_t act_block;         // scale block along the row; 0 = unscaled (native recipe)
  std::string scale_dtype;
  int64_t scale_itemsize;
  std::string compute_dtype; // dtype of combine rows and of gradients travelling back
  int64_t compute_itemsize;
  int64_t num_combine_slots; // topk, + 1 with shared experts
};

struct Region {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t offset;  // bytes from the start of the buffer, a multiple of kRegionAlign
  int64_t nbytes;
};

constexpr int64_t kRegionAlign = 256;

// Rows in the expert-major pool: every (token, k) of every rank may land here, plus at most
// block_m - 1 rows of padding per expert, rounded so the pool is whole blocks.
int64_t pool_rows(const LayoutSpec& spec);

std::vector<Region> buffer_layout(const LayoutSpec& spec);

}  // namespace megamoe
