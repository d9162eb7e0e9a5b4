"""MegaMoEConfig: the one description of a MegaMoE layer's shapes and numerics."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .precision import PrecisionRecipe, get_recipe

_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MegaMoEConfig:
    """Shapes and numerics of one MegaMoE layer (and of the symmetric buffer it needs).

    num_experts: routed experts over the whole expert-parallel group.
    hidden, intermediate: model width H and per-expert FFN width I (fc1 is [2*I, H]).
    topk: experts per token K.
    num_max_tokens_per_rank: most tokens one rank may pass in one call; sizes the buffer.
    recipe: "bf16", "fp8", "fp8_e4m3_wgrad" or "mxfp8_mxfp4" (see precision.py).
    num_shared_experts, shared_intermediate: shared experts run on every token, fused into one
      MLP of width num_shared_experts * shared_intermediate (shared_intermediate defaults to
      intermediate).
    activation_clamp: c, applied as gate = min(gate, c), up = clamp(up, -c, c) before SwiGLU.
    dtype: activation / output dtype and the dtype combine rows travel in. bfloat16 is what
      training uses; float32 gives exact comparisons in tests.
    block_m: rows per M-block of the GPU executor's Triton fp8 GEMM (the fallback where the CUDA
      extension was not built); each expert's pool segment is padded to a multiple of it there
      (the reference executor pads nothing; the CUTLASS and bf16 GEMMs pad to 16, and recipe
      fp8_e4m3_wgrad to 128 so that no 1x128 wgrad block spans two experts).
    """

    num_experts: int
    hidden: int
    intermediate: int
    topk: int
    num_max_tokens_per_rank: int
    recipe: str = "bf16"
    num_shared_experts: int = 0
    shared_intermediate: int | None = None
    activation_clamp: float | None = None
    dtype: torch.dtype = torch.bfloat16
    block_m: int = 128

    def __post_init__(self):
        for name in ("num_experts", "hidden", "intermediate", "topk", "num_max_tokens_per_rank", "block_m"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk: {self.topk} exceeds num_experts={self.num_experts}")
        if self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m: must be a power of two, got {self.block_m}")
        recipe = get_recipe(self.recipe)
        if self.dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"dtype: must be one of {_COMPUTE_DTYPES}, got {self.dtype}")
        if (
            not isinstance(self.num_shared_experts, int)
            or isinstance(self.num_shared_experts, bool)
            or self.num_shared_experts < 0
        ):
            raise ValueError(f"num_shared_experts: must be an int >= 0, got {self.num_shared_experts!r}")
        if self.shared_intermediate is not None:
            if self.num_shared_experts == 0:
                raise ValueError("shared_intermediate: set but num_shared_experts is 0")
            if not isinstance(self.shared_intermediate, int) or self.shared_intermediate <= 0:
                raise ValueError(f"shared_intermediate: must be a positive int, got {self.shared_intermediate!r}")
        clamp = self.activation_clamp  # a number: a string would pass float() and fail in torch.clamp
        if clamp is not None and (not isinstance(clamp, numbers.Real) or isinstance(clamp, bool) or not clamp > 0):
            raise ValueError(f"activation_clamp: must be > 0, got {self.activation_clamp!r}")
        # Block-scaled recipes need whole scale blocks along every reduction dim.
        if recipe.quantized:
            for name in ("hidden", "intermediate"):
                value = getattr(self, name)
                for block in {recipe.act_block, recipe.weight_block[1]}:
                    if value % block:
                        raise ValueError(f"{name}: {value} must be a multiple of {block} for recipe {self.recipe!r}")
            if recipe.weight_block[0] > 1 and self.hidden % recipe.weight_block[0]:
                raise ValueError(
                    f"hidden: {self.hidden} must be a multiple of {recipe.weight_block[0]} for recipe {self.recipe!r}"
                )
        if self.intermediate % recipe.gate_up_chunk:
            raise ValueError(
                f"intermediate: {self.intermediate} must be a multiple of {recipe.gate_up_chunk} "
                f"(gate/up interleave chunk of recipe {self.recipe!r})"
            )
        if recipe.weight_format == "e2m1" and self.hidden % 2:
            raise ValueError(f"hidden: {self.hidden} must be even to pack FP4 weights")

    @property
    def precision(self) -> PrecisionRecipe:
        return get_recipe(self.recipe)

    @property
    def shared_width(self) -> int:
        """Width of the fused shared-expert MLP (0 without shared experts)."""
        return self.num_shared_experts * (self.shared_intermediate or self.intermediate)

    def experts_per_rank(self, num_ranks: int) -> int:
        if self.num_experts % num_ranks:
            raise ValueError(f"num_experts: {self.num_experts} is not divisible by the group size {num_ranks}")
        return self.num_experts // num_ranks
