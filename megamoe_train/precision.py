"""Precision recipes: how activations and expert weights are stored and scaled.

Every backend reads the numerics of a recipe from here, so "fp8" means the same thing in the
reference oracle, the GPU kernels and the weight transforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionRecipe:
    """Storage format of one recipe.

    act_format / weight_format: "native" (the config's compute dtype), "e4m3" or "e2m1".
    act_block: scale block length along the reduction (last) dim of an activation row.
    weight_block: (rows, cols) of one weight scale block, cols along the reduction dim.
    scale_format: "fp32" (any float scale) or "ue8m0" (power of two, stored as a biased
    8-bit exponent).
    gate_up_chunk: fc1 rows are interleaved gate/up in chunks of this many rows, so one
    N-tile of the L1 GEMM holds matching gate and up columns. fp8 keeps whole 128-row
    scale blocks per chunk. Native weights are not interleaved (weights.py reads them in
    master order, in place); for them it only sets the granularity `intermediate` must have
    (8 bf16 = 16 bytes, the row alignment torch's grouped GEMM needs).
    grad_format: how backward's two dgrad GEMMs (dY @ W2, reducing over H; dH @ W1, reducing over
    2I) read their operands: "native" (the gradient in the compute dtype, on the forward's
    dequantized weights) or "e4m3": the gradient quantized exactly like an activation (1 x
    act_block blocks along the reduction dim, scale_format scales: quant.py's quantize_grad)
    against the weights as quant.py's quantize_weight_t stores them: the master weight transposed
    (W2^T [I, H], W1^T [H, 2I] with fc1 in master order [gate; up]) and quantized in weight_block
    blocks along its own last dim, the dgrad's reduction dim. With square blocks (fp8) those are
    the forward's blocks read transposed, bit for bit; with 1 x 32 blocks (mxfp8_mxfp4) a second
    quantization of the master weights, blocked along the other axis.
    wgrad_format: how backward's two weight-gradient GEMMs (dW2 = dY^T a, dW1 = dH^T x, reducing
    over the expert's pool rows) read both operands: "native" (the unquantized gradient and the
    stored activation dequantized, in the compute dtype) or "e4m3": each operand quantized per
    column in 1 x act_block blocks along the pool rows (tokens), the 128-row blocks counted from
    each expert's first pool row (padding rows zero), with the activation's rounding and
    scale_format scales (quant.py's quantize_tokens_t). The operands are dY as pulled (compute
    dtype), dH as backward keeps it (the SwiGLU backward's fp32 value rounded to the compute
    dtype) and the stored L2 / L1 inputs a, x (dequantized to fp32 first).
    """

    name: str
    act_format: str
    act_block: int
    weight_format: str
    weight_block: tuple[int, int]
    scale_format: str
    gate_up_chunk: int
    grad_format: str = "native"
    wgrad_format: str = "native"

    def __post_init__(self):
        if self.grad_format != "native" and self.act_block <= 0:
            raise ValueError(f"recipe {self.name!r}: quantized gradients need activation blocks (act_block)")
        if self.wgrad_format != "native" and self.act_block <= 0:
            raise ValueError(f"recipe {self.name!r}: a quantized wgrad needs activation blocks (act_block)")

    @property
    def quantized(self) -> bool:
        return self.act_format != "native"

    @property
    def mx(self) -> bool:
        """Power-of-two 1 x 32 scales (the MX recipe): Hopper's fp8 GEMMs, which apply one scale
        per 128-deep K block, read its operands folded into 1 x 128 (activations) and 128 x 128
        (weights) blocks (quant.fold_mx_act, fold_mx_weight)."""
        return self.scale_format == "ue8m0"

    def mma_scale_cols(self, width: int) -> int:
        """Scales per row of a quantized activation of `width` columns as the GPU GEMMs read it."""
        return width // (128 if self.mx else self.act_block)

    @property
    def quantized_dgrad(self) -> bool:
        """Whether backward's dgrad GEMMs take quantized gradients (and the weights quantized
        transposed, ExpertWeights.w1_t / w2_t)."""
        return self.grad_format != "native"

    @property
    def quantized_wgrad(self) -> bool:
        """Whether backward's wgrad GEMMs read both operands quantized along the token dim."""
        return self.wgrad_format != "native"

    def act_storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return compute_dtype if self.act_format == "native" else torch.float8_e4m3fn

    @property
    def scale_storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.scale_format == "ue8m0" else torch.float32


RECIPES: dict[str, PrecisionRecipe] = {
    "bf16": PrecisionRecipe("bf16", "native", 0, "native", (0, 0), "none", 8),
    # DeepSeek-V3 training recipe: 1x128 per-token activation blocks, 128x128 weight blocks;
    # the dgrad GEMMs take e4m3 gradients in 1x128 blocks too. The wgrads stay bf16: on H200 our
    # fp8 K-grouped wgrad GEMM (per-row scales on both operands) measured 0.81-0.87x bf16's
    # rate (2026-11-30: 2-4 K steps per tile, each with an unhidden fp32 promotion), and it
    # costs accuracy.
    "fp8": PrecisionRecipe("fp8", "e4m3", 128, "e4m3", (128, 128), "fp32", 128, grad_format="e4m3"),
    # fp8 with DeepSeek-V3's fp8 wgrads as well: both wgrad operands in 1x128 blocks along the
    # tokens (their reduction dim). Slower and less accurate than "fp8" today; for experiments.
    "fp8_e4m3_wgrad": PrecisionRecipe(
        "fp8_e4m3_wgrad", "e4m3", 128, "e4m3", (128, 128), "fp32", 128, grad_format="e4m3", wgrad_format="e4m3"
    ),
    # MX recipe of the seeds: E4M3 activations and E2M1 weights, 1x32 power-of-two scales. Its
    # dgrads read MXFP8 gradients (dY, dH: 1x32 blocks along H, 2I) against E2M1 copies of the
    # transposed master weights (W2^T, W1^T: 1x32 blocks along H, 2I); its wgrads stay bf16.
    "mxfp8_mxfp4": PrecisionRecipe("mxfp8_mxfp4", "e4m3", 32, "e2m1", (1, 32), "ue8m0", 8, grad_format="e4m3"),
}

# the recipes the GPU executor (backends/triton_backend.py) runs; the others run the reference on a GPU.
# mxfp8_mxfp4 runs on Hopper's fp8 MMA with its 1x32 scales folded into 1x128 / 128x128 blocks
# (quant.py's MX section); its E2M1 weights folded to e4m3 in HBM once per weight version, or
# expanded inside our expert GEMM (MEGAMOE_MX_GEMM=expanded, backends/triton_backend.py).
GPU_EXECUTOR_RECIPES = ("bf16", "fp8", "fp8_e4m3_wgrad", "mxfp8_mxfp4")


def get_recipe(name: str) -> PrecisionRecipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"recipe: unknown recipe {name!r}; choose one of {sorted(RECIPES)}") from None
