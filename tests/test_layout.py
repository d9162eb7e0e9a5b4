"""The C++ buffer layout against a plain-Python statement of the same rules, and its size; the
host extension's ordered barrier-word store and load."""

import ctypes

import pytest
import torch

from megamoe_train import MegaMoEConfig
from megamoe_train.layout import buffer_layout, layout_spec

ALIGN = 256


def python_layout(cfg: MegaMoEConfig, R: int):
    recipe = cfg.precision
    T, H, K = cfg.num_max_tokens_per_rank, cfg.hidden, cfg.topk
    act = recipe.act_storage_dtype(cfg.dtype)
    sc = recipe.scale_storage_dtype
    ab = recipe.act_block
    regions = [
        ("status", torch.int32, (2, R, 4)),
        ("x", act, (T, H)),
        *([("x_scales", sc, (T, H // ab))] if ab else []),
        ("topk_idx", torch.int32, (T, K)),
        ("topk_weights", torch.float32, (T, K)),
        ("grad_y", cfg.dtype, (T, H)),
        ("partials", cfg.dtype, (R + (1 if cfg.num_shared_experts else 0), T, H)),
        ("topk_weight_grads", torch.float32, (T, K)),
    ]
    out, offset = {}, 0
    for name, dtype, shape in regions:
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        out[name] = (dtype, shape, offset, nbytes)
        offset = -(-(offset + nbytes) // ALIGN) * ALIGN
    return out


CONFIGS = [
    dict(
        num_experts=8, hidden=64, intermediate=32, topk=2, num_max_tokens_per_rank=40, block_m=16, dtype=torch.float32
    ),
    dict(num_experts=256, hidden=4096, intermediate=2048, topk=6, num_max_tokens_per_rank=8192, recipe="fp8"),
    dict(
        num_experts=128,
        hidden=2048,
        intermediate=768,
        topk=8,
        num_max_tokens_per_rank=333,
        recipe="mxfp8_mxfp4",
        num_shared_experts=1,
    ),
    dict(num_experts=6, hidden=24, intermediate=8, topk=3, num_max_tokens_per_rank=1, block_m=1, dtype=torch.float16),
]


@pytest.mark.parametrize("kwargs", CONFIGS)
@pytest.mark.parametrize("R", [1, 2])
def test_layout_matches_python(kwargs, R):
    cfg = MegaMoEConfig(**kwargs)
    layout = buffer_layout(cfg, R)
    expected = python_layout(cfg, R)
    assert list(layout.regions) == list(expected)
    for name, reg in layout.regions.items():
        assert (reg.dtype, reg.shape, reg.offset, reg.nbytes) == expected[name], name
        assert reg.offset % ALIGN == 0
    # regions never overlap and the buffer ends after the last one
    spans = sorted((r.offset, r.offset + r.nbytes) for r in layout.regions.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert layout.nbytes == spans[-1][1]
    assert layout.nbytes_by_region == {name: e[3] for name, e in expected.items()}


# Benchmark shapes (E, K, H, I, T per rank) at EP=2: symmetric memory per rank, in bytes,
# as docs/protocol.md states them.
SHAPES = {"S1": (256, 6, 4096, 2048, 8192), "S2": (128, 8, 2048, 768, 16384), "S3": (8, 2, 4096, 14336, 8192)}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_buffer_size_of_benchmark_shapes(shape, recipe):
    E, K, H, I, T = SHAPES[shape]
    cfg = MegaMoEConfig(num_experts=E, topk=K, hidden=H, intermediate=I, num_max_tokens_per_rank=T, recipe=recipe)
    nbytes = buffer_layout(cfg, 2).nbytes
    a = 1 if recipe == "fp8" else 2
    scales = T * (H // 128) * 4 if recipe == "fp8" else 0
    # x, dY, 2 partials; ids, weights, d(weights); fp8 scales; alignment
    assert nbytes == pytest.approx(T * H * (a + 2 * 3) + T * K * 12 + scales, abs=ALIGN * 8)
    assert nbytes <= 0.5e9  # issue 10's bound at S1 bf16 (was 2.89 GB)


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


def test_barrier_word_store_release_load_acquire():
    from megamoe_train import _C

    words = (ctypes.c_int64 * 2)()
    at = ctypes.addressof(words)
    for value in (7, -(2**63), 2**63 - 1):
        _C.store_release_i64(at + 8, value)
        assert _C.load_acquire_i64(at + 8) == value == words[1]
    assert words[0] == 0  # the neighbouring word is untouched
    for bad in (at + 4, at + 1):
        with pytest.raises(ValueError, match="not 8-byte aligned"):
            _C.store_release_i64(bad, 1)
        with pytest.raises(ValueError, match="not 8-byte aligned"):
            _C.load_acquire_i64(bad)
    with pytest.raises(ValueError, match="null"):
        _C.load_acquire_i64(0)
    assert list(words) == [0, 2**63 - 1]  # a refused store writes nothing
