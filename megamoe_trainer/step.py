"""One optimizer step of `megamoe-train` on a rank: the LR schedule, the step's micro-batches
(forward and backward each, gradients kept in main_grad until the last), Megatron's gradient
finalization and the optimizer step (Adam, linear warmup + cosine decay).

The step's loss is the mean over micro-batches and data-parallel ranks: each micro-batch's
backward takes its loss over accum x DP, so DDP sums gradients unscaled (model.py; for a DP that
is a power of two the gradients are the bits of scaling after the backward). Megatron's aux
losses reach the router through the same scale.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from .recipe import Recipe

__all__ = ["lr_at", "set_lr", "set_recipe_hyperparams", "Stepper"]


def lr_at(step: int, recipe: Recipe) -> float:
    """LR for optimizer step `step` (1-based): linear warmup, then cosine from lr to min_lr."""
    t = recipe.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float):
    for group in optimizer.param_groups:
        group["lr"] = lr


def set_recipe_hyperparams(optimizer, recipe: Recipe):
    """The recipe's weight decay and betas in every param group. Megatron's param groups carry
    weight_decay = train.weight_decay for all of them and a wd_mult (0 for 1-D parameters: norms,
    biases) that only its OptimizerParamScheduler multiplies in, which this trainer does not run;
    and a checkpoint load replaces the groups with the writer's (its weight decay and betas)."""
    t = recipe.train
    for group in optimizer.param_groups:
        group["weight_decay"] = t.weight_decay * group.get("wd_mult", 1.0)
        group["betas"] = (t.adam_beta1, t.adam_beta2)


class Stepper:
    """Runs a rank's optimizer steps (`step`) on its slice of each global batch (`fetch`)."""

    def __init__(self, run):
        from megatron.core import parallel_state

        self.run = run
        t = run.recipe.train
        self.mbs, self.accum, self.gbs = t.micro_batch_size, t.grad_accum_steps, run.recipe.global_batch_size
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.loss_scale = 1.0 / (self.accum * self.dp_size)
        self.pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
        self.chunks = list(run.model) if isinstance(run.model, torch.nn.ModuleList) else [run.model]

    def fetch(self, step_start: int, micro: int) -> dict:
        """Micro-batch `micro` of the step whose samples start at step_start: micro-batch i
        covers the step's samples [i * dp * mbs, (i + 1) * dp * mbs), this rank its mbs of them
        (with one micro-batch per step: the rank's slice of the global batch)."""
        first_sample = step_start + (micro * self.dp_size + self.dp_rank) * self.mbs
        batch = self.run.corpus.batch(range(first_sample, first_sample + self.mbs))
        if self.run.device == "cuda":
            return {k: v.pin_memory().to(self.run.dev, non_blocking=True) for k, v in batch.items()}
        return batch

    def pipeline_step(self, batch: dict, consumed: int) -> tuple[torch.Tensor, dict]:
        """The step's micro-batches through Megatron's pipeline schedule (1F1B, or interleaved
        over virtual stages; gradients finalized). Every stage reads the micro-batches (the first
        stage the tokens, the last the labels); the mean loss comes from the last stage."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = [batch] + [self.fetch(consumed, micro) for micro in range(1, self.accum)]

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # [B, S]

            def loss_func(output):
                mask = b["loss_mask"]
                micro_loss = (output.float() * mask).sum() / mask.sum().clamp(min=1)
                # a copy: the schedule divides the loss by the micro-batches in place
                return micro_loss, {"loss": micro_loss.detach().clone()}

            return per_token, loss_func

        iters = [iter(batches) for _ in self.chunks]
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=self.accum,
            seq_length=self.run.recipe.model.seq_length,
            micro_batch_size=self.mbs,
            forward_only=False,
        )
        dev = batch["tokens"].device
        loss = torch.stack([d["loss"] for d in losses]).mean() if losses else torch.zeros((), device=dev)
        # the last stage's loss to every stage of the pipeline (the step's numbers are per rank)
        group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(loss, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
        return loss, batches[-1]

    @contextlib.contextmanager
    def aux_losses_scaled(self):
        """Megatron's MoE aux losses scaled like the main loss while the steps run (under
        pipeline parallelism the schedule scales them, model.pipeline_schedule)."""
        if self.loss_scale == 1.0 or self.pipelined:
            yield
            return
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(self.loss_scale, device=self.run.dev))
        try:
            yield
        finally:  # no CUDA tensor left in a class attribute for interpreter exit to free
            MoEAuxLossAutoScaler.main_loss_backward_scale = None

    def step(self, lr: float, batch: dict, consumed: int, prefetch: bool) -> tuple[torch.Tensor, dict | None]:
        """One optimizer step at `lr` from `batch`, the first micro-batch of the step whose samples
        start at `consumed`. Returns this rank's [loss, success, grad norm] as one device tensor
        (not reduced; no host sync) and, with prefetch, the next step's first micro-batch, made
        while the GPU works through this step."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        model, optimizer, accum = self.run.model, self.run.optimizer, self.accum
        set_lr(optimizer, lr)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = 0.0
        if self.pipelined:
            loss, batch = self.pipeline_step(batch, consumed)
        for micro in range(0 if self.pipelined else accum):  # gradients add up in main_grad; DDP reduces after the last
            with model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [B, S]
                mask = batch["loss_mask"]
                micro_loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
                (micro_loss * self.loss_scale).backward()
            loss = loss + micro_loss.detach() / accum
            if micro < accum - 1:
                batch = self.fetch(consumed, micro + 1)
        if not self.pipelined:  # the pipeline schedule finalizes them itself
            finalize_model_grads([model])
        ok, grad_norm, _ = optimizer.step()
        next_batch = self.fetch(consumed + self.gbs, 0) if prefetch else None

        # loss, success, grad norm as one device tensor (torch.full: a host value sent to the GPU
        # with torch.tensor would synchronize)
        if not isinstance(grad_norm, torch.Tensor):
            grad_norm = torch.full((), float("nan") if grad_norm is None else float(grad_norm), device=loss.device)
        values = torch.stack(
            [
                loss.detach().float(),
                torch.full((), float(ok), device=loss.device),
                grad_norm.detach().float().reshape(()),
            ]
        )
        return values, next_batch
