"""megamoe-train: trains a Megatron-core GPT whose MoE layers run through MegaMoE, from a YAML recipe.

    megamoe-train RECIPE.yaml [options]          # or: python -m megamoe_trainer RECIPE.yaml

Modules: `cli` (validate, start the ranks), `recipe` (schema, each section's checks; `schema`: typed
mappings), `model` (GPTModel from the `megatron_patch` spec, DDP, optimizer), `train` (the per-rank
loop, in four pieces: `rank_setup`, `step`, `checkpoint`, `step_stats` + `report`), `data`,
`flops` (FLOPs per token, MFU), `profiling`, and `perf/` (the general speed-ups that stand in for
Transformer Engine / Apex, switched by the recipe's `perf` section).

Importing this package imports neither megatron-core nor torch: the CLI silences megatron-core's
import-time warnings first.
"""
