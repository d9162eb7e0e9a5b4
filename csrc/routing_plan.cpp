#include "routing_plan.h"

#include <stdexcept>
#include <string>

namespace megamoe {

SendPlan build_send_plan(const int64_t* topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                         int64_t num_ranks) {
  if (num_ranks <= 0 || num_experts <= 0 || num_experts % num_ranks)
    throw std::invalid_argument("build_send_plan: num_experts must be a positive multiple of num_ranks");
  const int64_t per_rank = num_experts / num_ranks;
  const int64_t slots = num_tokens * topk;
  SendPlan plan;
  plan.counts.assign(num_ranks * per_rank, 0);
  plan.names.assign(num_ranks * slots, -1);

  // Pass 1: counts per global expert (== [owner, local expert] flattened).
  for (int64_t name = 0; name < slots; ++name) {
    const int64_t expert = topk_idx[name];
    if (expert < 0) continue;
    if (expert >= num_experts)
      throw std::invalid_argument("build_send_plan: expert id " + std::to_string(expert) + " at token " +
                                  std::to_string(name / topk) + " is outside [0, " + std::to_string(num_experts) + ")");
    ++plan.counts[expert];
  }
  // Exclusive prefix sum inside each owner gives every local expert's first position.
  std::vector<int64_t> cursor(num_experts);
  for (int64_t owner = 0; owner < num_ranks; ++owner) {
    int64_t running = 0;
    for (int64_t e = 0; e < per_rank; ++e) {
      cursor[owner * per_rank + e] = owner * slots + running;
      running += plan.counts[owner * per_rank + e];
    }
  }
  // Pass 2: scatter names; visiting names in order keeps each expert's list ascending.
  for (int64_t name = 0; name < slots; ++name) {
    const int64_t expert = topk_idx[name];
    if (expert >= 0) plan.names[cursor[expert]++] = static_cast<int32_t>(name);
  }
  return plan;
}

PoolPlan build_pool_plan(const int32_t* recv_counts, int64_t num_ranks, int64_t experts_per_rank, int64_t block_m,
                         int64_t owner_rank) {
  if (num_ranks <= 0 || experts_per_rank <= 0 || block_m <= 0)
    throw std::invalid_argument("build_pool_plan: sizes must be positive");
  if (owner_rank < 0 || owner_rank >= num_ranks) throw std::invalid_argument("build_pool_plan: owner_rank out of range");
  for (int64_t i = 0; i < num_ranks * experts_per_rank; ++i)
    if (recv_counts[i] < 0) throw std::invalid_argument("build_pool_plan: negative count");

  PoolPlan plan;
  plan.expert_offsets.assign(experts_per_rank + 1, 0);
  plan.expert_counts.assign(experts_per_rank, 0);
  for (int64_t e = 0; e < experts_per_rank; ++e) {
    int64_t count = 0;
    for (int64_t src = 0; src < num_ranks; ++src) count += recv_counts[src * experts_per_rank + e];
    plan.expert_counts[e] = static_cast<int32_t>(count);
    const int64_t padded = (count + block_m - 1) / block_m * block_m;
    plan.expert_offsets[e + 1] = static_cast<int32_t>(plan.expert_offsets[e] + padded);
  }
  const int64_t rows = plan.expert_offsets[experts_per_rank];
  plan.row_src.assign(rows, -1);
  plan.row_pos.assign(rows, -1);

  // Where expert e's names start in each source's list (lists are grouped by local expert).
  std::vector<int64_t> next(num_ranks), end(num_ranks);
  std::vector<int64_t> src_base(num_ranks, 0);
  for (int64_t e = 0; e < experts_per_rank; ++e) {
    for (int64_t src = 0; src < num_ranks; ++src) {
      next[src] = src_base[src];
      end[src] = src_base[src] + recv_counts[src * experts_per_rank + e];
      src_base[src] = end[src];
    }
    int64_t row = plan.expert_offsets[e];
    int64_t remaining = plan.expert_counts[e];
    int64_t src = (owner_rank + e) % num_ranks;
    while (remaining > 0) {
      if (next[src] < end[src]) {
        plan.row_src[row] = static_cast<int32_t>(src);
        plan.row_pos[row] = static_cast<int32_t>(next[src]++);
        ++row;
        --remaining;
      }
      src = (src + 1) % num_ranks;
    }
  }
  return plan;
}

}  // namespace megamoe
