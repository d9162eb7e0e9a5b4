"""The per-rank training loop of `megamoe-train` (started by `megatron_patch.cli`).

Builds a megatron-core GPTModel whose MoE layers come from the MegaMoE adapter spec, wraps it
in megatron-core DistributedDataParallel, optimizes with `get_megatron_optimizer` (Adam, linear
warmup + cosine decay), calls `finalize_model_grads` every step, logs progress on rank 0,
and checkpoints with `megatron.core.dist_checkpointing`.

    python -m megatron_patch.train RECIPE.yaml [options]     # same as megamoe-train
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .recipe import Recipe


def lr_at(step: int, recipe: Recipe) -> float:
    """LR for optimizer step `step` (1-based): linear warmup, then cosine from lr to min_lr."""
    t = recipe.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def transformer_config(recipe: Recipe):
    """The run's MegaMoETransformerConfig (also built by the validator, before any rank starts)."""
    from megatron_patch import MegaMoETransformerConfig

    m, moe, p = recipe.model, recipe.moe, recipe.parallel
    bf16 = m.dtype == "bf16"
    return MegaMoETransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        qk_layernorm=m.qk_layernorm,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.normalization,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=False,  # init through Megatron's RNG tracker: experts differ per EP rank
        tensor_model_parallel_size=p.tensor_parallel,
        expert_model_parallel_size=p.expert_parallel,
        sequence_parallel=False,
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_layer_freq=m.moe_layer_freq,
        moe_token_dispatcher_type="alltoall",
        moe_router_score_function=moe.router_score_function,
        moe_router_pre_softmax=moe.router_pre_softmax,
        moe_router_topk_scaling_factor=moe.router_topk_scaling_factor,
        moe_router_num_groups=moe.router_num_groups,
        moe_router_group_topk=moe.router_group_topk,
        moe_router_enable_expert_bias=moe.router_expert_bias,
        moe_router_bias_update_rate=moe.router_bias_update_rate,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff if moe.load_balancing != "none" else 0.0,
        moe_z_loss_coeff=moe.z_loss_coeff,
        moe_router_dtype="fp32",
        moe_megamoe_recipe=moe.megamoe_recipe,
        moe_megamoe_backend=moe.megamoe_backend,
        moe_megamoe_max_tokens_per_rank=recipe.max_tokens_per_rank,
    )


def build_model(recipe: Recipe, device: str):
    """GPTModel (MegaMoE spec) -> [Float16Module] -> DDP, and its Megatron optimizer."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_patch import get_megamoe_gpt_decoder_block_spec

    cfg = transformer_config(recipe)
    spec = get_megamoe_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    m = recipe.model
    gpt = GPTModel(
        cfg, spec, vocab_size=m.vocab_size, max_sequence_length=m.seq_length,
        position_embedding_type=m.position_embedding, rotary_base=m.rotary_base,
        share_embeddings_and_output_weights=False,
    )
    if device == "cuda":
        gpt.cuda(torch.cuda.current_device())
    # Replicated (non-expert) weights must start equal on every data-parallel rank; DDP does not
    # broadcast them, so copy them from the first rank of the data-parallel group.
    dp_group = parallel_state.get_data_parallel_group()
    src = dist.get_global_rank(dp_group, 0)
    with torch.no_grad():
        for p in gpt.parameters():
            if getattr(p, "allreduce", True):
                dist.broadcast(p.data, src=src, group=dp_group)
    model = Float16Module(cfg, gpt) if cfg.bf16 else gpt
    t = recipe.train
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=t.use_distributed_optimizer,
    )
    model = DistributedDataParallel(cfg, ddp_cfg, model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, clip_grad=t.clip_grad, bf16=cfg.bf16, fp16=False,
        use_distributed_optimizer=t.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [model])
    return model, optimizer, cfg


def _set_lr(optimizer, lr: float):
    for group in optimizer.param_groups:
        group["lr"] = lr


def _count_params(model) -> tuple[int, int]:
    total = expert = 0
    for p in model.parameters():
        total += p.numel()
        if not getattr(p, "allreduce", True):
            expert += p.numel()
    return total, expert


class StockRouterLoad:
    """Per-expert routed rows of Megatron's stock MoE layers (recipes with moe.megamoe_recipe: null),
    counted from each router's routing map; MegaMoE layers count their own (get_expert_load)."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.counts = [None] * len(self.routers)
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, inputs, output):
            if module.training:
                rows = output[1].sum(0).to(torch.int64)  # routing_map [T, E] -> rows per global expert
                self.counts[i] = rows if self.counts[i] is None else self.counts[i] + rows

        return hook

    def gather(self) -> torch.Tensor | None:
        """[layers, E] over the whole job (every rank's tokens), and reset."""
        if not self.routers or any(c is None for c in self.counts):
            return None
        load = torch.stack(self.counts)
        self.counts = [None] * len(self.routers)
        dist.all_reduce(load)
        return load.cpu()


def _gather_expert_load(model, device: str, stock: StockRouterLoad | None = None) -> torch.Tensor | None:
    """[num_moe_layers, E] rows each expert received this step, over the whole job."""
    from megatron.core import parallel_state

    from megatron_patch import get_expert_load

    local = get_expert_load(model, reset=True)
    if local is None or local.numel() == 0:
        return stock.gather() if stock is not None else None
    local = local.to(device=torch.cuda.current_device() if device == "cuda" else "cpu", dtype=torch.int64)
    # replicas of the same experts (expert data parallel) saw different tokens: sum them
    if parallel_state.get_expert_data_parallel_world_size() > 1:
        dist.all_reduce(local, group=parallel_state.get_expert_data_parallel_group())
    ep_group = parallel_state.get_expert_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, local, group=ep_group)
    return torch.cat(parts, dim=1).cpu()  # EP ranks hold contiguous expert ranges, in rank order


def run_rank(rank: int, world: int, recipe_dict: dict, run_dir: str, resume: bool):
    """Entry of every rank (torch.distributed is initialized by the launcher)."""
    from megatron_patch import cpu_compat

    from . import checkpoint as ckpt
    from .data import build_corpus
    from .recipe import _build
    from .report import MetricsLog, plot_progress

    recipe: Recipe = _build(Recipe, recipe_dict, "")
    device = "cuda" if torch.cuda.is_available() and recipe.parallel.device != "cpu" else "cpu"
    if device == "cpu":
        cpu_compat.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=recipe.parallel.tensor_parallel,
        expert_model_parallel_size=recipe.parallel.expert_parallel,
    )
    seed = recipe.run.seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    is_main = rank == 0
    say = (lambda *a: print(*a, flush=True)) if is_main else (lambda *a: None)
    t0 = time.perf_counter()
    model, optimizer, cfg = build_model(recipe, device)
    corpus = build_corpus(recipe, run_dir)
    stock_load = StockRouterLoad(model) if recipe.moe.megamoe_recipe is None else None
    total, expert = _count_params(model)
    expert_total = torch.tensor([expert], dtype=torch.int64, device=dev)  # NCCL reduces GPU tensors only
    dist.all_reduce(expert_total)  # every rank holds its own experts (expert-DP replicas: divide out)
    dense_params = total - expert  # replicated on every rank (TP 1)
    expert_params = int(expert_total) // max(1, parallel_state.get_expert_data_parallel_world_size())
    m, moe = recipe.model, recipe.moe
    from megatron.core.transformer.moe.moe_layer import MoELayer

    moe_layers = [type(mod).__name__ for mod in model.modules() if isinstance(mod, MoELayer)]
    say(f"[megamoe-train] {world} ranks on {device} | EP {recipe.parallel.expert_parallel}, TP {recipe.parallel.tensor_parallel}, "
        f"DP {recipe.data_parallel_size} | {m.num_layers} layers, hidden {m.hidden_size}, {moe.num_experts} experts "
        f"top-{moe.topk} (I={moe.ffn_hidden_size}{', shared ' + str(moe.shared_expert_ffn_hidden_size) if moe.shared_expert_ffn_hidden_size else ''}) | "
        f"MoE: {'MegaMoE ' + moe.megamoe_recipe if moe.megamoe_recipe else 'stock Megatron'} "
        f"({len(moe_layers)} x {moe_layers[0] if moe_layers else '-'}) | "
        f"params {(dense_params + expert_params) / 1e6:.2f} M ({expert_params / 1e6:.2f} M in experts) | "
        f"data: {recipe.data.path or 'synthetic'} | built in {time.perf_counter() - t0:.1f} s")

    start_step, consumed = 0, 0
    latest = ckpt.latest_checkpoint(run_dir) if resume else None
    if latest is not None:
        state = ckpt.load_checkpoint(latest, model, optimizer, device)
        start_step, consumed = state["step"], state["consumed_samples"]
        say(f"[megamoe-train] resumed from {latest} at step {start_step} ({consumed} samples consumed)")
    metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl"), start_step if latest else None) if is_main else None
    plot_path = os.path.join(run_dir, "progress.png")
    title = f"{os.path.basename(run_dir)}: {moe.num_experts} experts top-{moe.topk}, MegaMoE {moe.megamoe_recipe}"

    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    mbs, gbs = recipe.train.micro_batch_size, recipe.global_batch_size
    steps = recipe.train.steps
    last = min(steps, recipe.train.stop_at or steps)  # this invocation's final step
    if start_step >= last:
        say(f"[megamoe-train] nothing to do: the checkpoint is at step {start_step} (train.steps={steps}, train.stop_at={recipe.train.stop_at})")
    run_start = time.perf_counter()
    tokens_done, step_seconds = 0, 0.0
    last_ckpt_step = start_step
    window: list[float] = []  # losses since the last progress line
    model.train()
    for step in range(start_step + 1, last + 1):
        step_start = time.perf_counter()
        first = consumed + dp_rank * mbs
        batch = {k: v.to(dev, non_blocking=True) for k, v in corpus.batch(range(first, first + mbs)).items()}
        lr = lr_at(step, recipe)
        _set_lr(optimizer, lr)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [B, S]
        mask = batch["loss_mask"]
        loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        finalize_model_grads([model])
        ok, grad_norm, _ = optimizer.step()
        consumed += gbs

        stats = torch.stack([loss.detach().float(), torch.tensor(float(ok), device=loss.device)])
        dist.all_reduce(stats, group=dp_group)
        load = _gather_expert_load(model, device, stock_load)
        if device == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - step_start
        tokens_done += recipe.tokens_per_step
        step_seconds += step_time
        if is_main:
            dp = recipe.data_parallel_size
            record = {
                "step": step,
                "loss": stats[0].item() / dp,
                "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens_per_s": recipe.tokens_per_step / step_time,
                "step_time_s": step_time,
                "skipped": stats[1].item() < dp,
                "consumed_samples": consumed,
            }
            if load is not None:
                per_expert = load.sum(0).double()
                mean = per_expert.mean().item()
                layer_imb = (load.double().max(1).values / load.double().mean(1).clamp(min=1e-9))
                record["load_imbalance"] = per_expert.max().item() / mean if mean > 0 else None
                record["load_imbalance_worst_layer"] = layer_imb.max().item()
                record["expert_load"] = load.tolist()
            metrics.append(record)
            window.append(record["loss"])
            if step % recipe.run.log_every == 0 or step == start_step + 1 or step == last:
                imb = record.get("load_imbalance")
                gn = record["grad_norm"]
                avg = f" (mean of {len(window)}: {sum(window) / len(window):.4f})" if len(window) > 1 else ""
                window.clear()
                print(
                    f"step {step:5d}/{steps} | loss {record['loss']:.4f}{avg} | {record['tokens_per_s']:7.0f} tok/s | "
                    f"load max/mean {imb if imb is None else format(imb, '.2f')}"
                    f"{'' if imb is None else ' (worst layer ' + format(record['load_imbalance_worst_layer'], '.2f') + ')'} | "
                    f"lr {lr:.2e} | grad norm {gn if gn is None else format(gn, '.3f')}",
                    flush=True,
                )
            if recipe.run.plot_every and step % recipe.run.plot_every == 0:
                plot_progress(metrics.records, plot_path, title)
        if recipe.run.checkpoint and recipe.run.save_every and step % recipe.run.save_every == 0 and step != last:
            ckpt.save_checkpoint(run_dir, step, consumed, model, optimizer, device, {"recipe": recipe.to_dict()})
            last_ckpt_step = step
            say(f"[megamoe-train] checkpoint step {step} saved")

    if recipe.run.checkpoint and last > last_ckpt_step:
        path = ckpt.save_checkpoint(run_dir, last, consumed, model, optimizer, device, {"recipe": recipe.to_dict()})
        say(f"[megamoe-train] checkpoint saved: {path}")
    if is_main and metrics.records:
        plot_progress(metrics.records, plot_path, title)
        first_loss, last_loss = metrics.records[0]["loss"], metrics.records[-1]["loss"]
        wall = time.perf_counter() - run_start
        print(f"[megamoe-train] {'done' if last == steps else 'stopped (train.stop_at)'}: steps {start_step + 1}..{last} in {wall:.1f} s "
              f"({tokens_done / max(step_seconds, 1e-9):.0f} tok/s over the steps) | loss {first_loss:.4f} (step {metrics.records[0]['step']}) -> "
              f"{last_loss:.4f} (step {metrics.records[-1]['step']}) | metrics {metrics.path} | plot {plot_path}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    from .cli import main

    raise SystemExit(main())
