"""Expert weights in kernel layout: quantized once per weight update, then reused.

Megatron stores fc1 as [2*I, H] with every gate row first and every up row after. The
quantized L1 GEMMs instead want gate and up rows interleaved in chunks, so one N-tile holds
matching gate and up columns (the executors run SwiGLU as a pass of its own, reading the
interleaved columns, not in the GEMM's epilogue). Quantization happens in the master order
first, so a block's scale is the same whichever layout it is read in; the data and its scales
are then interleaved together.

Unquantized recipes (bf16) keep the master order (one chunk of width I: SwiGLU runs as its own
pass, so no interleave is needed) and read the parameter's own storage when its dtype is the
compute dtype: no copy per weight update at all.

Recipes with a quantized dgrad (fp8, mxfp8_mxfp4) also keep the dgrad GEMMs' weights: each master
weight transposed and quantized blocked along the dgrad's reduction dim (quant.quantize_weight_t;
w1_t, w2_t; fc1 in master order). For fp8's square blocks those are the forward's blocks
transposed; for mxfp8_mxfp4's 1 x 32 blocks a second quantization of the master weight. For CUDA
tensors one Triton kernel per weight reads the master weight once and writes both layouts with
their scales; elsewhere, and as its oracle, the torch ops of quant.py do, with the same bits. The
kernels are a backend's (backends/triton_weight_prep.py): the backends package supplies them here
(supply_weight_kernels), so this module imports none.

mxfp8_mxfp4 (E2M1 weights, ue8m0 scales in 1 x 32 blocks) is quantized on CUDA by that module's
E2M1 kernel too, one pass per weight writing the forward's copy and the transposed one, cached
like fp8. Its layout is quant.py's: quantize_weight's packed bytes and scales, fc1's rows
interleaved in chunks of gate_up_chunk (8) like fp8's; w1_t / w2_t are quantize_weight_t's. The
GPU executor's CUTLASS fp8 GEMMs read all four folded to e4m3 with 128 x 128 power-of-two scales
(mma_operands, mma_dgrad_operands, quant.fold_mx_weight; made once per weight version, twice
E2M1's bytes); with MEGAMOE_MX_GEMM=expanded our expert GEMM reads them as stored and expands them
to e4m3 in shared memory, with the shifts and block scales of mx_gemm_operands /
mx_dgrad_gemm_operands (quant.mx_weight_shifts, a few bytes per 32 weights). The reference
executor dequantizes them. No bf16 copy of the weights is made for its backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .config import MegaMoEConfig
from .precision import PrecisionRecipe, get_recipe
from .quant import dequantize_weight, fold_mx_weight, mx_weight_shifts, quantize_weight, quantize_weight_t


def _gate_up_dims(t: torch.Tensor, chunk: int, dim: int) -> tuple[int, int]:
    """Normalised dim and number of chunks per half, after checking the sizes fit."""
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"dim: {dim} is out of range for a {t.dim()}-d tensor")
    dim %= t.dim()
    size = t.shape[dim]
    if not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk: must be a positive int, got {chunk!r}")
    if size % 2 or (size // 2) % chunk:
        raise ValueError(f"gate/up dim {dim} has size {size}; it must be 2 * I with I a multiple of chunk={chunk}")
    return dim, size // 2 // chunk


def interleave_gate_up(t: torch.Tensor, chunk: int, dim: int = -2) -> torch.Tensor:
    """[gate; up] along dim -> [gate 0:c, up 0:c, gate c:2c, up c:2c, ...]."""
    dim, chunks = _gate_up_dims(t, chunk, dim)
    return t.unflatten(dim, (2, chunks, chunk)).transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def deinterleave_gate_up(t: torch.Tensor, chunk: int, dim: int = -2) -> torch.Tensor:
    """Inverse of interleave_gate_up: back to all gate rows, then all up rows."""
    dim, chunks = _gate_up_dims(t, chunk, dim)
    return t.unflatten(dim, (chunks, 2, chunk)).transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


@dataclass
class ExpertWeights:
    """One rank's expert weights as the kernels read them.

    w1: fc1, gate/up interleaved in chunks of `chunk` rows: [E, 2I, H] (native or e4m3) or
      packed FP4 [E, 2I, H/2] (quant.pack_fp4's order; ue8m0 scales [E, 2I, H/32]). Native
      (unquantized) weights have chunk == I (master order) and alias the caller's tensor when it
      already has the compute dtype. w1_scales: its block scales, interleaved the same way, or None.
    w2: fc2, [E, H, I] or packed [E, H, I/2]; w2_scales likewise.
    Recipes with quantized dgrad (precision.grad_format: fp8, mxfp8_mxfp4) also carry the B
    operands of the dgrad GEMMs (grad_act = dY_q @ w2_t[e]^T, grad_x = dH_q @ w1_t[e]^T):
    quant.quantize_weight_t of the master weights (None for the other recipes):
    w1_t: fc1 in master order ([gate; up], not interleaved, so its columns line up with dH's)
      transposed and quantized along 2I: e4m3 [E, H, 2I] with fp32 scales [E, H/128, 2I/128]
      (fp8: the forward's blocks transposed, so dequantized it is deinterleave(dequantize(w1))
      transposed, bit for bit), or packed E2M1 [E, H, I] with ue8m0 scales [E, H, 2I/32]
      (mxfp8_mxfp4: 1 x 32 blocks along 2I, a quantization of their own).
    w2_t: fc2 transposed and quantized along H: e4m3 [E, I, H] with fp32 [E, I/128, H/128], or
      packed E2M1 [E, I, H/2] with ue8m0 [E, I, H/32].
    """

    recipe: str
    w1: torch.Tensor
    w1_scales: torch.Tensor | None
    w2: torch.Tensor
    w2_scales: torch.Tensor | None
    chunk: int
    w1_t: torch.Tensor | None = None
    w1_t_scales: torch.Tensor | None = None
    w2_t: torch.Tensor | None = None
    w2_t_scales: torch.Tensor | None = None

    def dequantize_w1(self) -> torch.Tensor:
        """float32 [E, 2I, H], still interleaved (scale blocks never straddle a chunk)."""
        return dequantize_weight(self.w1, self.w1_scales, get_recipe(self.recipe))

    def dequantize_w2(self) -> torch.Tensor:
        """float32 [E, H, I]."""
        return dequantize_weight(self.w2, self.w2_scales, get_recipe(self.recipe))

    def dequantize_w1_t(self) -> torch.Tensor:
        """float32 [E, H, 2I]: fc1 as the quantized dgrad reads it (master order, transposed)."""
        return dequantize_weight(self._dgrad_weight("w1_t"), self.w1_t_scales, get_recipe(self.recipe))

    def dequantize_w2_t(self) -> torch.Tensor:
        """float32 [E, I, H]: fc2 as the quantized dgrad reads it (transposed)."""
        return dequantize_weight(self._dgrad_weight("w2_t"), self.w2_t_scales, get_recipe(self.recipe))

    def _dgrad_weight(self, name: str) -> torch.Tensor:
        w = getattr(self, name)
        if w is None:
            raise ValueError(f"ExpertWeights.{name}: recipe {self.recipe!r} has no quantized dgrad, so no {name}")
        return w

    @property
    def quantized(self) -> bool:
        return self.w1_scales is not None

    def freeze_operands(self) -> None:
        """From now on the derived operands below (mma_operands, mma_dgrad_operands,
        mx_gemm_operands, mx_dgrad_gemm_operands, compute_copies) are only read: one not made yet
        raises instead of being made. For a graphed layer's prepared weights, whose derived
        operands its weight-preparation graph makes (the executor's prepare_weights): one made
        later, inside a captured forward or backward, would be remade by that graph's replays
        only, and the other captured pair would read it stale after a weight update."""
        self.__dict__["_operands_frozen"] = True

    def _may_derive(self, operand: str) -> None:
        if self.__dict__.get("_operands_frozen"):
            raise RuntimeError(
                f"ExpertWeights.{operand}: not made before these weights were frozen (freeze_operands); the "
                f"executor's prepare_weights must make every operand derived from the weights that it reads"
            )

    def resident_bytes(self) -> int:
        """Bytes of the distinct storages this object holds: the quantized weights, their
        transposed dgrad copies and every derived operand made so far (folds, shifts, compute
        copies). What a recipe's expert weights cost beside the master weights; native weights
        that alias the caller's tensor are counted too."""
        storages: dict[int, int] = {}

        def visit(x) -> None:
            if isinstance(x, torch.Tensor):
                storage = x.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            elif isinstance(x, (tuple, list)):
                for y in x:
                    visit(y)

        for name in ("w1", "w1_scales", "w2", "w2_scales", "w1_t", "w1_t_scales", "w2_t", "w2_t_scales"):
            visit(getattr(self, name))
        for key, value in self.__dict__.items():
            if key.startswith("_"):  # the cached derived operands
                visit(value)
        return sum(storages.values())

    def mma_operands(
        self, *, use_kernel: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(w1, w1_scales, w2, w2_scales) as the GPU executor's GEMMs read them: the stored weights,
        or for the MX recipe (precision.PrecisionRecipe.mx) those folded to e4m3 with fp32
        power-of-two 128 x 128 block scales (quant.fold_mx_weight; w1 still interleaved), made once
        per weight version (this object lives as long as its cache entry). On CUDA one Triton
        kernel per weight (use_kernel as in quantize_expert_weights; the same bits)."""
        if not get_recipe(self.recipe).mx:
            return self.w1, self.w1_scales, self.w2, self.w2_scales
        cached = self.__dict__.get("_mma_operands")
        if cached is None:
            self._may_derive("mma_operands")
            cached = self._folded(_prep_kernels(self.w1.device, use_kernel))
            self.__dict__["_mma_operands"] = cached
        return cached

    def mma_dgrad_operands(
        self, *, use_kernel: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1_t, w1_t_scales, w2_t, w2_t_scales) as the GPU executor's fp8 dgrad GEMMs read them:
        the stored ones (fp8), or for the MX recipe those folded as in mma_operands, made once per
        weight version."""
        self._dgrad_weight("w1_t")
        if not get_recipe(self.recipe).mx:
            return self.w1_t, self.w1_t_scales, self.w2_t, self.w2_t_scales
        cached = self.__dict__.get("_mma_dgrad_operands")
        if cached is None:
            self._may_derive("mma_dgrad_operands")
            kernels = _prep_kernels(self.w1_t.device, use_kernel)
            cached = self._folded(kernels, self.w1_t, self.w1_t_scales, self.w2_t, self.w2_t_scales)
            self.__dict__["_mma_dgrad_operands"] = cached
        return cached

    def _folded(self, kernels: WeightKernels | None, *weights: torch.Tensor | None):
        """fold_mx_weight of each (data, scales) pair, by default (w1, w1_scales, w2, w2_scales): by
        the supplied kernels, else the torch ops."""
        fold = kernels.fold_e2m1_blocks if kernels is not None else fold_mx_weight
        weights = weights or (self.w1, self.w1_scales, self.w2, self.w2_scales)
        return tuple(t for data, scales in zip(weights[::2], weights[1::2]) for t in fold(data, scales))

    def mx_gemm_operands(self) -> tuple[torch.Tensor, ...]:
        """The MX recipe's weights as the expert GEMM that expands E2M1 in shared memory reads them
        (cutlass_gemm.fp8_expert_gemm_mx): (w1 packed, w1 shifts, w1 block scales, w2 packed, w2
        shifts, w2 block scales), the shifts and scales quant.mx_weight_shifts' of the stored
        scales, made once per weight version."""
        cached = self.__dict__.get("_mx_gemm_operands")
        if cached is None:
            self._may_derive("mx_gemm_operands")
            cached = (self.w1, *mx_weight_shifts(self.w1_scales), self.w2, *mx_weight_shifts(self.w2_scales))
            self.__dict__["_mx_gemm_operands"] = cached
        return cached

    def mx_dgrad_gemm_operands(self) -> tuple[torch.Tensor, ...]:
        """mx_gemm_operands of the dgrad's weights: (w1_t packed, its shifts, its block scales, w2_t
        packed, its shifts, its block scales), made once per weight version."""
        cached = self.__dict__.get("_mx_dgrad_gemm_operands")
        if cached is None:
            self._may_derive("mx_dgrad_gemm_operands")
            w1_t, w2_t = self._dgrad_weight("w1_t"), self._dgrad_weight("w2_t")
            cached = (w1_t, *mx_weight_shifts(self.w1_t_scales), w2_t, *mx_weight_shifts(self.w2_t_scales))
            self.__dict__["_mx_dgrad_gemm_operands"] = cached
        return cached

    def compute_copies(
        self, dtype: torch.dtype, *, use_kernel: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) as the forward used them, in `dtype` and master order (fc1 [gate; up]), made
        once per weight version (this object lives as long as its cache entry): what backward
        dgrad GEMMs read in recipes whose dgrad is not quantized (bf16; a quantized dgrad reads
        w1_t, w2_t). fp8 on CUDA: one fused dequantize + deinterleave kernel per weight (use_kernel
        as in quantize_expert_weights; both paths give the same bits); other recipes the torch ops."""
        if (
            not self.quantized
            and self.w1.dtype == dtype
            and self.w2.dtype == dtype
            and 2 * self.chunk == self.w1.shape[1]
        ):
            return self.w1, self.w2  # already master order in dtype (often the parameters themselves)
        cached = self.__dict__.get("_compute_copies")
        if cached is None or cached[0] != dtype:
            self._may_derive(f"compute_copies({dtype})")
            recipe = get_recipe(self.recipe)
            # the dequantize kernel reads e4m3 in 2-D fp32 blocks (fp8's weights)
            kernels = _prep_kernels(self.w1.device, use_kernel) if _kernel_format(recipe) == "e4m3" else None
            if kernels is not None and dtype not in kernels.master_dtypes(self.w1.device):
                kernels = None
            if kernels is not None:
                block = recipe.weight_block
                w1 = kernels.dequantize_blocks(self.w1, self.w1_scales, dtype, block, chunk=self.chunk)
                w2 = kernels.dequantize_blocks(self.w2, self.w2_scales, dtype, block)
            else:
                w1 = deinterleave_gate_up(self.dequantize_w1(), self.chunk).to(dtype)
                w2 = self.dequantize_w2().to(dtype)
            cached = (dtype, w1, w2)
            self.__dict__["_compute_copies"] = cached
        return cached[1], cached[2]


def _kernel_format(recipe: PrecisionRecipe) -> str | None:
    """The weight format whose weight-prep kernel quantizes the recipe's weights: "e4m3" (2-D fp32
    block scales: fp8), "e2m1" (ue8m0 scales in 1 x 32 blocks: mxfp8_mxfp4); None: the torch ops."""
    if recipe.weight_format == "e4m3" and recipe.scale_format == "fp32":
        return "e4m3"
    if recipe.weight_format == "e2m1" and recipe.scale_format == "ue8m0" and recipe.weight_block == (1, 32):
        return "e2m1"
    return None


class WeightKernels(Protocol):
    """The weight-prep kernels that a backend supplies (backends/triton_weight_prep.py, a module):
    bit for bit quant.py's torch ops and the gate/up (de)interleave."""

    def supports(self, device: torch.device) -> bool: ...

    def master_dtypes(self, device: torch.device, weight_format: str = "e4m3") -> tuple[torch.dtype, ...]: ...

    def quantize_blocks(
        self, w: torch.Tensor, block: tuple[int, int], chunk: int | None = None
    ) -> tuple[torch.Tensor, ...]: ...

    def quantize_e2m1_blocks(
        self, w: torch.Tensor, chunk: int | None = None, transposed: bool = True
    ) -> tuple[torch.Tensor | None, ...]: ...

    def dequantize_blocks(
        self,
        data: torch.Tensor,
        scales: torch.Tensor,
        dtype: torch.dtype,
        block: tuple[int, int],
        chunk: int | None = None,
    ) -> torch.Tensor: ...

    def fold_e2m1_blocks(self, data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


_load_kernels: Callable[[], WeightKernels] | None = None


def supply_weight_kernels(load: Callable[[], WeightKernels] | None) -> None:
    """How to get the weight-prep kernels: load() returns them, or raises ImportError where they
    cannot be loaded (no triton). The backends package calls this when it is imported, which
    importing megamoe_train always does; until then every path runs the torch ops."""
    global _load_kernels
    _load_kernels = load


def _prep_kernels(device: torch.device, use_kernel: bool | None) -> WeightKernels | None:
    """The supplied weight-prep kernels if they should run: None = for CUDA tensors where they
    load and the GPU has e4m3; True = always (CPU tensors need TRITON_INTERPRET=1);
    False = never (the torch ops)."""
    if use_kernel is False:
        return None
    try:
        if _load_kernels is None:
            raise ImportError("no backend supplied the weight-prep kernels (megamoe_train.backends does)")
        kernels = _load_kernels()
    except ImportError:
        if use_kernel:
            raise
        return None
    if use_kernel or (device.type == "cuda" and kernels.supports(device)):
        return kernels
    return None


# w1 -> (cache key, weakref to w2, result). Keyed by identity: a plain WeakKeyDictionary
# compares tensors with ==, which is elementwise and fails. Entries die with w1, and values
# never reference w1 or w2, so a cached result cannot keep a freed parameter alive.
_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()


# Bumped by clear_weight_cache(): holders of prepared weights outside _CACHE (a graphed layer's
# static copy) compare weight_state() and so see the clear too.
_GENERATION = 0


def clear_weight_cache() -> None:
    """Forget every cached transform, e.g. after writing weights through `.data`."""
    global _GENERATION
    _GENERATION += 1
    _CACHE.clear()


def weight_state(w1: torch.Tensor, w2: torch.Tensor, config: MegaMoEConfig) -> tuple:
    """What a prepared copy of (w1, w2) depends on: equal states, equal transforms."""
    # _version counts in-place writes through the tensor or its views (optimizer steps,
    # no_grad add_); data_ptr catches `param.data = other`. Writes through `param.data.` do
    # not bump the version and are invisible here: call clear_weight_cache() after them.
    return (
        w1._version,
        w2._version,
        w1.data_ptr(),
        w2.data_ptr(),
        _GENERATION,
        config.recipe,
        config.dtype,
        config.intermediate,
        config.hidden,
    )


def _check_weight(name: str, w, expected: tuple[int, int]) -> None:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise ValueError(f"{name}: expected a floating dtype, got {w.dtype}")
    if w.dim() != 3 or tuple(w.shape[1:]) != expected or w.shape[0] == 0:
        raise ValueError(f"{name}: expected shape [E, {expected[0]}, {expected[1]}], got {list(w.shape)}")


def _check_weights(w1, w2, config: MegaMoEConfig) -> None:
    inter, hidden = config.intermediate, config.hidden
    _check_weight("w1", w1, (2 * inter, hidden))
    _check_weight("w2", w2, (hidden, inter))
    if w1.shape[0] != w2.shape[0]:
        raise ValueError(f"w2: expected {w1.shape[0]} experts to match w1, got shape {list(w2.shape)}")
    if w1.device != w2.device:
        raise ValueError(f"w2: expected device {w1.device} to match w1, got {w2.device}")


def transform_weights(w1: torch.Tensor, w2: torch.Tensor, config: MegaMoEConfig) -> ExpertWeights:
    """Master expert weights -> kernel layout, cached until w1 or w2 changes.

    w1: [E, 2*I, H] fc1 (gate rows, then up rows); w2: [E, H, I] fc2. Calling again with
    the same unchanged tensors and an equivalent config returns the same object. While a CUDA
    graph is being captured the transform is captured too (no cache).
    """
    _check_weights(w1, w2, config)
    if w1.is_cuda and torch.cuda.is_current_stream_capturing():
        # A captured graph replays the transform itself, so every replay reads the weights as
        # they are then; nothing computed during capture may be handed to an eager call.
        return _transform(w1.detach(), w2.detach(), config)
    key = weight_state(w1, w2, config)
    hit = _CACHE.get(w1)
    if hit is not None and hit[0] == key and hit[1]() is w2:
        return hit[2]
    result = _transform(w1.detach(), w2.detach(), config)
    _CACHE[w1] = (key, weakref.ref(w2), result)
    return result


@torch.no_grad()
def _transform(w1: torch.Tensor, w2: torch.Tensor, config: MegaMoEConfig) -> ExpertWeights:
    recipe = config.precision
    if recipe.weight_format == "native":
        # Master order, no copy when the dtype matches: the kernels read the parameter itself, so
        # writes through `.data` (mixed-precision optimizers) are seen without invalidation.
        return ExpertWeights(
            recipe=recipe.name,
            w1=w1.to(config.dtype).contiguous(),
            w1_scales=None,
            w2=w2.to(config.dtype).contiguous(),
            w2_scales=None,
            chunk=config.intermediate,
        )
    return quantize_expert_weights(w1, w2, config)


@torch.no_grad()
def quantize_expert_weights(
    w1: torch.Tensor, w2: torch.Tensor, config: MegaMoEConfig, *, use_kernel: bool | None = None
) -> ExpertWeights:
    """Quantized recipes: master weights -> ExpertWeights, uncached (transform_weights caches).

    use_kernel (fp8 and mxfp8_mxfp4): None runs the Triton kernel for CUDA tensors where it can and
    the torch ops otherwise; True / False force one. Both give the same bits.
    """
    _check_weights(w1, w2, config)
    recipe = config.precision
    if recipe.weight_format == "native":
        raise ValueError(f"recipe: {recipe.name!r} does not quantize weights")
    chunk = recipe.gate_up_chunk
    # A scale row covers weight_block[0] data rows; config guarantees chunk is a multiple.
    scale_chunk = chunk // recipe.weight_block[0]
    weight_format = _kernel_format(recipe)
    kernels = _prep_kernels(w1.device, use_kernel) if weight_format else None
    if (
        use_kernel is None
        and kernels is not None
        and not {w1.dtype, w2.dtype} <= set(kernels.master_dtypes(w1.device, weight_format))
    ):
        kernels = None  # e.g. float64 masters: the torch ops
    if use_kernel and kernels is None:
        raise ValueError(
            f"use_kernel: the weight-prep kernels handle fp8 and mxfp8_mxfp4 weights only, not {recipe.name!r}"
        )
    if kernels is not None:
        if weight_format == "e2m1":  # the transposed copy is a quantization of its own: asked for
            transposed = recipe.quantized_dgrad
            w1_data, w1_scales, w1_t, w1_t_scales = kernels.quantize_e2m1_blocks(w1, chunk=chunk, transposed=transposed)
            w2_data, w2_scales, w2_t, w2_t_scales = kernels.quantize_e2m1_blocks(w2, transposed=transposed)
        else:  # the e4m3 kernel writes the transposed blocks in the same pass anyway
            w1_data, w1_scales, w1_t, w1_t_scales = kernels.quantize_blocks(w1, recipe.weight_block, chunk=chunk)
            w2_data, w2_scales, w2_t, w2_t_scales = kernels.quantize_blocks(w2, recipe.weight_block)
        dgrad_operands = {}
        if recipe.quantized_dgrad:
            dgrad_operands = dict(w1_t=w1_t, w1_t_scales=w1_t_scales, w2_t=w2_t, w2_t_scales=w2_t_scales)
        return ExpertWeights(
            recipe=recipe.name,
            w1=w1_data,
            w1_scales=w1_scales,
            w2=w2_data,
            w2_scales=w2_scales,
            chunk=chunk,
            **dgrad_operands,
        )
    w1_data, w1_scales = quantize_weight(w1, recipe)
    w2_data, w2_scales = quantize_weight(w2, recipe)
    dgrad_operands = {}
    if recipe.quantized_dgrad and recipe.weight_block[0] == recipe.weight_block[1]:
        # quantize_weight_t's blocks are the forward's read transposed: transposed, not requantized
        dgrad_operands = dict(
            w1_t=w1_data.mT.contiguous(),
            w1_t_scales=w1_scales.mT.contiguous(),
            w2_t=w2_data.mT.contiguous(),
            w2_t_scales=w2_scales.mT.contiguous(),
        )
    elif recipe.quantized_dgrad:
        w1_t, w1_t_scales = quantize_weight_t(w1, recipe)
        w2_t, w2_t_scales = quantize_weight_t(w2, recipe)
        dgrad_operands = dict(w1_t=w1_t, w1_t_scales=w1_t_scales, w2_t=w2_t, w2_t_scales=w2_t_scales)
    return ExpertWeights(
        recipe=recipe.name,
        w1=interleave_gate_up(w1_data, chunk),
        w1_scales=interleave_gate_up(w1_scales, scale_chunk),
        w2=w2_data,
        w2_scales=w2_scales,
        chunk=chunk,
        **dgrad_operands,
    )
