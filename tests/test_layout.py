"""The C++ buffer layout against a plain-Python statement of the same rules."""

import pytest
import torch

from megamoe_train import MegaMoEConfig
from megamoe_train.layout import buffer_layout, layout_spec

ALIGN = 256


def python_layout(cfg: MegaMoEConfig, R: int):
    recipe = cfg.precision
    E, T, H, I, K, bm = cfg.num_experts // R, cfg.num_max_tokens_per_rank, cfg.hidden, cfg.intermediate, cfg.topk, cfg.block_m
    P = -(-R * T * K // bm) * bm + E * bm
    act = recipe.act_storage_dtype(cfg.dtype)
    sc = recipe.scale_storage_dtype
    ab = recipe.act_block
    regions = [
        ("status", torch.int32, (2, R, 4)),
        ("signals", torch.int32, (2, R)),
        ("recv_counts", torch.int32, (R, E)),
        ("recv_names", torch.int32, (R, T * K)),
        ("arrival", torch.int32, (P // bm,)),
        ("row_src", torch.int32, (P,)),
        ("row_name", torch.int32, (P,)),
        ("x", act, (T, H)),
        *([("x_scales", sc, (T, H // ab))] if ab else []),
        ("topk_idx", torch.int32, (T, K)),
        ("topk_weights", torch.float32, (T, K)),
        ("grad_y", cfg.dtype, (T, H)),
        ("pool_x", act, (P, H)),
        *([("pool_x_scales", sc, (P, H // ab))] if ab else []),
        ("pool_act", act, (P, I)),
        *([("pool_act_scales", sc, (P, I // ab))] if ab else []),
        ("pool_weights", torch.float32, (P,)),
        ("pool_grad", cfg.dtype, (P, H)),
        ("combine", cfg.dtype, (cfg.num_combine_slots, T, H)),
        ("combine_weight_grads", torch.float32, (T, K)),
    ]
    out, offset = {}, 0
    for name, dtype, shape in regions:
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        out[name] = (dtype, shape, offset, nbytes)
        offset = -(-(offset + nbytes) // ALIGN) * ALIGN
    return P, out


CONFIGS = [
    dict(num_experts=8, hidden=64, intermediate=32, topk=2, num_max_tokens_per_rank=40, block_m=16, dtype=torch.float32),
    dict(num_experts=256, hidden=4096, intermediate=2048, topk=6, num_max_tokens_per_rank=8192, recipe="fp8"),
    dict(num_experts=128, hidden=2048, intermediate=768, topk=8, num_max_tokens_per_rank=333, recipe="mxfp8_mxfp4", num_shared_experts=1),
    dict(num_experts=6, hidden=24, intermediate=8, topk=3, num_max_tokens_per_rank=1, block_m=1, dtype=torch.float16),
]


@pytest.mark.parametrize("kwargs", CONFIGS)
@pytest.mark.parametrize("R", [1, 2])
def test_layout_matches_python(kwargs, R):
    cfg = MegaMoEConfig(**kwargs)
    layout = buffer_layout(cfg, R)
    P, expected = python_layout(cfg, R)
    assert layout.pool_rows == P
    assert list(layout.regions) == list(expected)
    for name, reg in layout.regions.items():
        assert (reg.dtype, reg.shape, reg.offset, reg.nbytes) == expected[name], name
        assert reg.offset % ALIGN == 0
    # regions never overlap and the buffer ends after the last one
    spans = sorted((r.offset, r.offset + r.nbytes) for r in layout.regions.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert layout.nbytes == spans[-1][1]


def test_layout_rejects_bad_spec():
    cfg = MegaMoEConfig(**CONFIGS[0])
    from megamoe_train import _C

    spec = layout_spec(cfg, 2)
    with pytest.raises(ValueError, match="num_ranks"):
        _C.buffer_layout(dict(spec, num_ranks=0))
    with pytest.raises(ValueError, match="act_block"):
        _C.buffer_layout(dict(spec, act_block=7))
    with pytest.raises(ValueError, match="num_experts"):
        buffer_layout(cfg, 3)  # 8 experts over 3 ranks
