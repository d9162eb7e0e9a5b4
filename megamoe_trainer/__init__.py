"""megamoe-train: trains a Megatron-core GPT whose MoE layers run through MegaMoE, from a YAML recipe.

    megamoe-train RECIPE.yaml [options]          # or: python -m megamoe_trainer RECIPE.yaml

Modules: `cli` (validate, start the ranks), `recipe` (schema, checks), `model` (GPTModel from the
`megatron_patch` spec, DDP, optimizer), `attention` (SDPA core attention), `fused_optimizer`
(multi-tensor norm / clip / Adam), `train` (the per-rank loop), `data`, `checkpoint`, `report`
(metrics.jsonl, progress.png), `flops` (FLOPs per token, MFU), `profiling`.

Importing this package imports neither megatron-core nor torch: the CLI silences megatron-core's
import-time warnings first.
"""
