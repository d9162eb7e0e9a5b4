"""A rank's start in `megamoe-train`: its model-parallel groups and seeds, the model and its
optimizer, the data, and the run's first line (`set_up_rank`, called by `train.run_rank`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import perf
from .recipe import Recipe, runs_on_cuda

__all__ = ["RankRun", "set_up_rank", "init_parallel", "describe"]


@dataclass
class RankRun:
    """What one rank trains: the recipe, its device, model, optimizer and data."""

    rank: int
    world: int
    recipe: Recipe
    run_dir: str
    device: str  # "cuda" or "cpu"
    dev: torch.device
    model: Any  # megatron DDP(Float16Module(GPTModel)) (model.build_model)
    optimizer: Any  # megatron's (chained) optimizer
    config: Any  # the run's MegaMoETransformerConfig
    corpus: Any  # data.SyntheticCorpus or data.IndexedCorpus
    peak_tflops: float | None = None  # per-GPU peak for the MFU; None: none known for the device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def say(self, *parts):
        """Print on rank 0 only."""
        if self.is_main:
            print(*parts, flush=True)


def init_parallel(recipe: Recipe, device: str):
    """Megatron's model-parallel groups and the run's seeds (CPU: megatron-core's CPU shims first)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if device == "cpu":
        from megatron_patch import cpu_compat

        cpu_compat.apply()
    p = recipe.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_stages,
        expert_model_parallel_size=p.expert_parallel,
        expert_tensor_parallel_size=1,  # experts unsplit (Megatron's default would be tensor_parallel)
    )
    torch.manual_seed(recipe.run.seed)
    model_parallel_cuda_manual_seed(recipe.run.seed)


def set_up_rank(rank: int, world: int, recipe: Recipe, run_dir: str) -> RankRun:
    """Groups, seeds, model, optimizer and data of this rank (collective), and the first line on rank 0."""
    from .data import build_corpus
    from .flops import peak_tflops
    from .model import build_model

    device = "cuda" if runs_on_cuda(recipe) else "cpu"
    init_parallel(recipe, device)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = recipe.train.tf32_matmul
    t0 = time.perf_counter()
    model, optimizer, cfg = build_model(recipe, device)
    corpus = build_corpus(recipe, run_dir)
    peak = peak_tflops(recipe, torch.cuda.get_device_name(dev) if device == "cuda" else None)
    run = RankRun(rank, world, recipe, run_dir, device, dev, model, optimizer, cfg, corpus, peak)
    run.say(describe(run, time.perf_counter() - t0))
    return run


def describe(run: RankRun, built_s: float) -> str:
    """The run's first line (collective: counts the experts of every rank)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_patch.grad_buffers import overwrites_expert_main_grads

    from .flops import train_flops_per_token
    from .model import count_params

    recipe, model, dev = run.recipe, run.model, run.dev
    _, expert = count_params(model)
    expert_total = torch.tensor([expert], dtype=torch.int64, device=dev)  # NCCL reduces GPU tensors only
    dist.all_reduce(expert_total)  # every rank holds its own experts (expert-DP replicas: divide out)
    # dense weights: TP-split ones summed over the TP ranks, the others (norms, router) once;
    # the pipeline stages hold different layers
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dense = sum(
        p.numel() if getattr(p, "tensor_model_parallel", False) else p.numel() / tp
        for n, p in model.named_parameters()
        if getattr(p, "allreduce", True) and ".mlp.experts." not in n
    )
    dense_total = torch.tensor([round(dense)], dtype=torch.int64, device=dev)
    dist.all_reduce(dense_total, group=parallel_state.get_model_parallel_group())
    dense_params = int(dense_total)
    expert_params = int(expert_total) // max(1, parallel_state.get_expert_data_parallel_world_size())
    m, moe, p = recipe.model, recipe.moe, recipe.parallel
    moe_layers = [type(mod).__name__ for mod in model.modules() if isinstance(mod, MoELayer)]
    shared = f", shared {moe.shared_expert_ffn_hidden_size}" if moe.shared_expert_ffn_hidden_size else ""
    graphs, executor = False, ""  # what the MoE layers will decide at their first call
    if moe.megamoe_recipe:
        from megatron_patch import cuda_graphs_enabled, describe_megamoe_executor, megamoe_config

        executor = f" on {describe_megamoe_executor(model.config, dev)}"
        if dev.type == "cuda":
            graphs = cuda_graphs_enabled(
                model.config, megamoe_config(model.config, dtype=model.config.params_dtype), dev
            )
    return (
        f"[megamoe-train] {run.world} ranks on {run.device} | EP {p.expert_parallel}, TP {p.tensor_parallel}"
        f"{' (sequence parallel)' if p.tensor_parallel > 1 else ''}, PP {p.pipeline_parallel}"
        f"{f' x {p.virtual_pipeline_stages} virtual' if p.virtual_pipeline_stages else ''}, "
        f"DP {recipe.data_parallel_size} | {m.num_layers} layers, hidden {m.hidden_size}, {moe.num_experts} experts "
        f"top-{moe.topk} (I={moe.ffn_hidden_size}{shared}) | "
        f"MoE: {'MegaMoE ' + moe.megamoe_recipe if moe.megamoe_recipe else 'stock Megatron'} "
        f"({len(moe_layers)} x {moe_layers[0] if moe_layers else '-'}{executor}"
        f"{', CUDA graphs' if graphs else ''}) | "
        f"params {(dense_params + expert_params) / 1e6:.2f} M ({expert_params / 1e6:.2f} M in experts) | "
        f"{train_flops_per_token(recipe) / 1e9:.2f} GFLOP/token"
        f"{f' (MFU vs {run.peak_tflops:g} TFLOP/s per GPU)' if run.peak_tflops is not None else ''} | "
        f"attention {recipe.perf.attention} | "
        f"{perf.describe(run.optimizer, recipe.train.adam_moments_dtype)}"
        f"{'expert main_grads written over, not zeroed | ' if overwrites_expert_main_grads(model) else ''}"
        f"data: {recipe.data.path or 'synthetic'} | built in {built_s:.1f} s"
    )
