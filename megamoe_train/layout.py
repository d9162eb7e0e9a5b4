"""Symmetric buffer layout of a config and group size (computed by the C++ host code, the one
source of region sizes and offsets for host code and kernels alike).

Per rank, with T = num_max_tokens_per_rank, H = hidden, K = topk, R = ranks, a = bytes of a
dispatched activation (1 for fp8, else the compute dtype's), c = bytes of the compute dtype,
s = 1 with shared experts:

    nbytes ~= T*H*(a + c*(R + 1 + s)) + T*(H/128)*4 (fp8 scales) + T*K*12 + alignment

x (a), dY (c) and one partial row per (owner rank, token) pushed home (c each, plus the shared
experts' own row); ids, topk weights and d(topk weight) are T*K each. Nothing scales with the
number of experts or with K times a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _C
from .config import MegaMoEConfig

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.uint8: "uint8",
    torch.int32: "int32",
}
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class Region:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of one rank's buffer
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along the last dimension."""
        return self.shape[-1] * self.dtype.itemsize


@dataclass(frozen=True)
class BufferLayout:
    num_ranks: int
    regions: dict[str, Region]

    @property
    def nbytes(self) -> int:
        last = max(self.regions.values(), key=lambda r: r.offset)
        return last.offset + last.nbytes

    @property
    def nbytes_by_region(self) -> dict[str, int]:
        return {name: r.nbytes for name, r in self.regions.items()}


def layout_spec(config: MegaMoEConfig, num_ranks: int) -> dict:
    """The plain-int description of the buffer that the C++ layout code consumes."""
    recipe = config.precision
    act_dtype = recipe.act_storage_dtype(config.dtype)
    scale_dtype = recipe.scale_storage_dtype
    return dict(
        num_ranks=num_ranks,
        max_tokens=config.num_max_tokens_per_rank,
        hidden=config.hidden,
        topk=config.topk,
        act_dtype=_DTYPE_NAMES[act_dtype],
        act_itemsize=act_dtype.itemsize,
        act_block=recipe.act_block,
        scale_dtype=_DTYPE_NAMES[scale_dtype],
        scale_itemsize=scale_dtype.itemsize,
        compute_dtype=_DTYPE_NAMES[config.dtype],
        compute_itemsize=config.dtype.itemsize,
        shared_experts=1 if config.num_shared_experts else 0,
    )


def buffer_layout(config: MegaMoEConfig, num_ranks: int) -> BufferLayout:
    config.experts_per_rank(num_ranks)  # the experts must split evenly over the group
    regions = {
        name: Region(name, _DTYPES_BY_NAME[dtype], tuple(shape), offset, nbytes)
        for name, dtype, shape, offset, nbytes in _C.buffer_layout(layout_spec(config, num_ranks))
    }
    return BufferLayout(num_ranks=num_ranks, regions=regions)
