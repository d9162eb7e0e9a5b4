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

    def fetch(self, step_start: int, micro: int) -> dict:
        """Micro-batch `micro` of the step whose samples start at step_start: micro-batch i
        covers the step's samples [i * dp * mbs, (i + 1) * dp * mbs), this rank its mbs of them
        (with one micro-batch per step: the rank's slice of the global batch)."""
        first_sample = step_start + (micro * self.dp_size + self.dp_rank) * self.mbs
        batch = self.run.corpus.batch(range(first_sample, first_sample + self.mbs))
        if self.run.device == "cuda":
            return {k: v.pin_memory().to(self.run.dev, non_blocking=True) for k, v in batch.items()}
        return batch

    @contextlib.contextmanager
    def aux_losses_scaled(self):
        """Megatron's MoE aux losses scaled like the main loss while the steps run."""
        if self.loss_scale == 1.0:
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
        for micro in range(accum):  # gradients add up in main_grad; DDP reduces after the last
            with model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [B, S]
                mask = batch["loss_mask"]
                micro_loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
                (micro_loss * self.loss_scale).backward()
            loss = loss + micro_loss.detach() / accum
            if micro < accum - 1:
                batch = self.fetch(consumed, micro + 1)
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
