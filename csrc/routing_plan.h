// Routing plan on the host: what each source rank announces to each expert owner, and
// where every announced row lands in the owner's expert-major pool.
#pragma once

#include <cstdint>
#include <vector>

namespace megamoe {

// Source side. For topk_idx [T, K] (global expert ids, -1 = masked) it gives, for every
// owner rank o, the names (token*K + k) routed to o, grouped by o's local expert and in
// ascending name order inside an expert, and the count per (owner, local expert).
struct SendPlan {
  std::vector<int32_t> counts;  // [num_ranks, experts_per_rank]
  std::vector<int32_t> names;   // [num_ranks, T*K], -1 past each owner's total
};

SendPlan build_send_plan(const int64_t* topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                         int64_t num_ranks);

// Owner side. From recv_counts [num_ranks, experts_per_rank] (what each source announced),
// place rows expert-major, each expert's segment padded to block_m rows. Inside an expert,
// rows take source ranks round-robin, starting at (owner_rank + expert) % num_ranks so that
// owners and experts start their reads on different peers; exhausted sources are skipped.
// Each row records its source rank and its position in that source's name list (-1, -1 for
// padding rows).
struct PoolPlan {
  std::vector<int32_t> expert_offsets;  // [experts_per_rank + 1], multiples of block_m
  std::vector<int32_t> expert_counts;   // [experts_per_rank] real rows per expert
  std::vector<int32_t> row_src;         // [expert_offsets.back()]
  std::vector<int32_t> row_pos;         // [expert_offsets.back()]
};

PoolPlan build_pool_plan(const int32_t* recv_counts, int64_t num_ranks, int64_t experts_per_rank, int64_t block_m,
                         int64_t owner_rank);

}  // namespace megamoe
