"""Symmetric buffer layout of a config and group size (computed by the C++ host code)."""

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


@dataclass(frozen=True)
class BufferLayout:
    num_ranks: int
    pool_rows: int
    regions: dict[str, Region]

    @property
    def nbytes(self) -> int:
        last = max(self.regions.values(), key=lambda r: r.offset)
        return last.offset + last.nbytes


def layout_spec(config: MegaMoEConfig, num_ranks: int) -> dict:
    """The plain-int description of the buffer that the C++ layout code consumes."""
    recipe = config.precision
    act_dtype = recipe.act_storage_dtype(config.dtype)
    scale_dtype = recipe.scale_storage_dtype
    return dict(
        num_ranks=num_ranks,
        num_local_experts=config.experts_per_rank(num_ranks),
        max_tokens=config.num_max_tokens_per_rank,
        hidden=config.hidden,
        intermediate=config.intermediate,
        topk=config.topk,
        block_m=config.block_m,
        act_dtype=_DTYPE_NAMES[act_dtype],
        act_itemsize=act_dtype.itemsize,
        act_block=recipe.act_block,
        scale_dtype=_DTYPE_NAMES[scale_dtype],
        scale_itemsize=scale_dtype.itemsize,
        compute_dtype=_DTYPE_NAMES[config.dtype],
        compute_itemsize=config.dtype.itemsize,
        num_combine_slots=config.num_combine_slots,
    )


def buffer_layout(config: MegaMoEConfig, num_ranks: int) -> BufferLayout:
    spec = layout_spec(config, num_ranks)
    regions = {
        name: Region(name, _DTYPES_BY_NAME[dtype], tuple(shape), offset, nbytes)
        for name, dtype, shape, offset, nbytes in _C.buffer_layout(spec)
    }
    return BufferLayout(num_ranks=num_ranks, pool_rows=_C.pool_rows(spec), regions=regions)
