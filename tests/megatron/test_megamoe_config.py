"""MegaMoETransformerConfig / validate_megamoe: every unsupported setting is rejected by name."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_patch import MegaMoEConfigError, MegaMoETransformerConfig, max_tokens_per_rank, validate_megamoe  # noqa: E402

BASE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=128,
    num_moe_experts=4,
    moe_router_topk=2,
    gated_linear_unit=True,
    activation_func=F.silu,
    add_bias_linear=False,
    expert_model_parallel_size=2,
)


def make(**overrides):
    return MegaMoETransformerConfig(**{**BASE, "moe_megamoe_recipe": "bf16", **overrides})


def test_valid_configs():
    for recipe in ("bf16", "fp8", "mxfp8_mxfp4"):
        cfg = make(
            moe_megamoe_recipe=recipe,
            hidden_size=128,
            moe_ffn_hidden_size=128,
            moe_shared_expert_intermediate_size=128,
            activation_func_clamp_value=7.0,
        )
        assert cfg.moe_megamoe_recipe == recipe and cfg.moe_megamoe_backend == "auto"
        assert cfg.moe_megamoe_max_tokens_per_rank is None
    # recipe None: stock Megatron, nothing MegaMoE-specific is checked
    stock = MegaMoETransformerConfig(
        **{**BASE, "add_bias_linear": True, "gated_linear_unit": False, "activation_func": F.gelu}
    )
    assert stock.moe_megamoe_recipe is None


# (setting named in the error, constructor overrides)
REJECTED = [
    ("moe_megamoe_recipe", dict(moe_megamoe_recipe="int4")),
    ("moe_megamoe_backend", dict(moe_megamoe_backend="cutlass-dream")),
    ("moe_megamoe_max_tokens_per_rank", dict(moe_megamoe_max_tokens_per_rank=0)),
    ("num_moe_experts", dict(num_moe_experts=3, moe_router_topk=2)),
    ("expert_tensor_parallel_size", dict(expert_tensor_parallel_size=2)),
    # Megatron defaults expert_tensor_parallel_size to tensor_model_parallel_size
    ("expert_tensor_parallel_size", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ("sequence_parallel", dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)),
    ("moe_expert_capacity_factor", dict(moe_expert_capacity_factor=1.0, moe_token_dispatcher_type="alltoall")),
    ("gated_linear_unit", dict(gated_linear_unit=False)),
    ("activation_func", dict(activation_func=F.gelu)),
    ("glu_linear_offset", dict(glu_linear_offset=1.0)),
    ("add_bias_linear", dict(add_bias_linear=True)),
    ("moe_latent_size", dict(moe_latent_size=32)),
    ("hidden_size", dict(moe_megamoe_recipe="fp8")),  # fp8 needs 128-multiples
    ("moe_ffn_hidden_size", dict(moe_megamoe_recipe="fp8", hidden_size=128, moe_ffn_hidden_size=96)),
    ("moe_shared_expert_gate", dict(moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True)),
    (
        "moe_shared_expert_overlap",
        dict(
            moe_shared_expert_intermediate_size=96, moe_shared_expert_overlap=True, moe_token_dispatcher_type="alltoall"
        ),
    ),
]


@pytest.mark.parametrize("setting,overrides", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected_at_construction(setting, overrides):
    with pytest.raises(ValueError) as err:  # MegaMoEConfigError, or Megatron's own check first
        make(**overrides)
    if err.type is MegaMoEConfigError:
        assert str(err.value).startswith(setting + ":"), str(err.value)
    else:  # Megatron rejected it itself; ours must still name it when asked directly
        pytest.fail(f"Megatron rejected {setting} before MegaMoE: {err.value}")


# settings Megatron's own __post_init__ constrains: set after construction, validate directly
LATE = [
    ("moe_router_padding_for_quantization", True),
    ("moe_pad_expert_input_to_capacity", True),
    ("moe_token_dropping", True),
    ("moe_apply_probs_on_input", True),
    ("moe_mlp_glu_interleave_size", 32),
    ("moe_single_grouped_weight", True),
    ("overlap_moe_expert_parallel_comm", True),
    ("overlap_dispatch_backward_with_experts_wgrad", True),
    ("transformer_impl", "inference_optimized"),
    ("cuda_graph_impl", "transformer_engine"),
]


@pytest.mark.parametrize("setting,value", LATE, ids=[r[0] for r in LATE])
def test_rejected_by_validate(setting, value):
    cfg = make()
    setattr(cfg, setting, value)
    with pytest.raises(MegaMoEConfigError, match=f"^{setting}:"):
        validate_megamoe(cfg)


def test_tensor_parallel_with_sequence_parallel_accepted():
    """TP for attention and dense layers, sequence parallelism, experts unsplit (ETP 1), with
    pipeline and context parallelism beside it."""
    cfg = make(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)
    assert cfg.tensor_model_parallel_size == 2 and cfg.expert_tensor_parallel_size == 1
    make(
        pipeline_model_parallel_size=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_tensor_parallel_size=1,
        num_layers=4,
        pipeline_dtype=torch.float32,
    )
    make(context_parallel_size=2)


def test_rank_capacity_factor_rejected_with_the_flex_dispatcher():
    """Stock's flex dispatchers drop (hybridep) or refuse (ncclep) tokens past the per-rank budget;
    the other dispatchers ignore it, as MegaMoE may."""
    cfg = make(moe_token_dispatcher_type="alltoall")
    cfg.moe_expert_rank_capacity_factor = 1.5
    validate_megamoe(cfg)
    cfg.moe_token_dispatcher_type = "flex"
    with pytest.raises(MegaMoEConfigError, match="^moe_expert_rank_capacity_factor:"):
        validate_megamoe(cfg)


def test_cuda_graph_needs_one_forward_in_flight():
    assert make(moe_megamoe_cuda_graph=True).moe_megamoe_cuda_graph
    for settings in (
        dict(recompute_granularity="selective"),
        dict(pipeline_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, sequence_parallel=True),  # with shared experts (below)
    ):
        cfg = make(moe_megamoe_cuda_graph=True, moe_shared_expert_intermediate_size=64)
        for setting, value in settings.items():
            setattr(cfg, setting, value)
        with pytest.raises(MegaMoEConfigError, match="^moe_megamoe_cuda_graph:"):
            validate_megamoe(cfg)
        cfg.moe_megamoe_cuda_graph = False
        validate_megamoe(cfg)  # only the graphs need it


def test_cuda_graph_refused_for_a_repeated_mtp_layer():
    """mtp_use_repeated_layer calls the one MTP layer (a MegaMoE layer where the decoder's last layer
    is MoE) mtp_num_layers times per forward: several forwards in flight, which a graphed layer cannot
    hold (each backward replay would read the latest forward's activations)."""
    import torch

    from megatron_patch import cuda_graphs_enabled, megamoe_config

    cfg = make(moe_megamoe_cuda_graph=True)
    cfg.mtp_num_layers, cfg.mtp_use_repeated_layer = 2, True
    with pytest.raises(MegaMoEConfigError, match="^moe_megamoe_cuda_graph:.*mtp"):
        validate_megamoe(cfg)
    cfg.moe_megamoe_cuda_graph = None  # graphs wherever they can work: not here
    assert not cuda_graphs_enabled(cfg, megamoe_config(cfg), torch.device("cuda"))
    cfg.mtp_num_layers = 1  # one call per forward
    cfg.moe_megamoe_cuda_graph = True
    validate_megamoe(cfg)


def test_fused_wgrad_accumulation_with_graphs():
    assert make(moe_megamoe_fuse_wgrad_accumulation=True).moe_megamoe_fuse_wgrad_accumulation
    cfg = make(moe_megamoe_fuse_wgrad_accumulation=True, moe_megamoe_cuda_graph=True)  # the graph adds into main_grad
    assert cfg.moe_megamoe_fuse_wgrad_accumulation and cfg.moe_megamoe_cuda_graph


def test_layer_without_recipe_refuses():
    from megatron_patch import MegaMoEMoELayer

    cfg = MegaMoETransformerConfig(**BASE)
    with pytest.raises(MegaMoEConfigError, match="^moe_megamoe_recipe:"):
        MegaMoEMoELayer(cfg)


def test_max_tokens_per_rank():
    assert max_tokens_per_rank(4096, 2) == 8192
    assert max_tokens_per_rank(4096, 2, context_parallel_size=2) == 4096
    assert max_tokens_per_rank(4096, 2, tensor_model_parallel_size=4, sequence_parallel=True) == 2048
    assert max_tokens_per_rank(4096, 2, tensor_model_parallel_size=4) == 8192


def test_megakernel_registration_is_a_noop_on_0_19():
    from megatron_patch import register_megakernel_backend

    try:
        import megatron.core.transformer.moe.megakernel.factory  # noqa: F401
    except ImportError:
        assert register_megakernel_backend() is False
    else:
        assert register_megakernel_backend() is True


# ---- names: one list each, from the core ---------------------------------------------------
def test_recipe_and_backend_names_come_from_the_core():
    from megamoe_train.backends import NAMES
    from megamoe_train.precision import RECIPES as CORE_RECIPES
    from megatron_patch.config import BACKENDS, RECIPES

    assert RECIPES == tuple(CORE_RECIPES)
    assert BACKENDS == ("auto", *NAMES) and "triton" in BACKENDS and "reference" in BACKENDS


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
def test_every_backend_name_passes_validation(backend):
    """The backend registry fills lazily (triton on first use); validation must not depend on it."""
    from megatron_patch.config import BACKENDS

    assert backend in BACKENDS
    cfg = make(moe_megamoe_backend=backend)
    validate_megamoe(cfg)
    assert cfg.moe_megamoe_backend == backend


# ---- the one Megatron -> MegaMoEConfig translation ------------------------------------------
def test_megamoe_config_translation():
    import torch

    from megatron_patch.config import megamoe_config

    cfg = make(
        hidden_size=128,
        moe_ffn_hidden_size=256,
        moe_shared_expert_intermediate_size=384,
        activation_func_clamp_value=7.0,
        moe_megamoe_max_tokens_per_rank=512,
    )
    mm = megamoe_config(cfg)
    assert (mm.num_experts, mm.hidden, mm.intermediate, mm.topk) == (4, 128, 256, 2)
    assert (mm.num_shared_experts, mm.shared_intermediate, mm.activation_clamp) == (1, 384, 7.0)
    assert mm.num_max_tokens_per_rank == 512 and mm.recipe == "bf16" and mm.dtype == torch.bfloat16
    mm = megamoe_config(cfg, num_max_tokens_per_rank=64, dtype=torch.float32)
    assert mm.num_max_tokens_per_rank == 64 and mm.dtype == torch.float32
    # moe_ffn_hidden_size unset: Megatron's own fallback (ffn_hidden_size) in every caller
    cfg = make()
    assert cfg.moe_ffn_hidden_size == 128 and megamoe_config(cfg).intermediate == 128
    cfg.moe_ffn_hidden_size = None
    assert megamoe_config(cfg).intermediate == cfg.ffn_hidden_size
    mm = megamoe_config(make())
    assert mm.num_shared_experts == 0 and mm.activation_clamp is None and mm.num_max_tokens_per_rank == 1
    with pytest.raises(MegaMoEConfigError, match="^moe_ffn_hidden_size:"):
        megamoe_config(_with_recipe("fp8", hidden_size=128, moe_ffn_hidden_size=96))


def _with_recipe(recipe, **overrides):
    cfg = MegaMoETransformerConfig(**{**BASE, **overrides})  # stock config, then switched on (no __post_init__ check)
    cfg.moe_megamoe_recipe = recipe
    return cfg


@pytest.mark.parametrize("env, expected", [(None, False), ("0", False), ("1", True), ("auto", None)])
def test_megatron_lm_configs_get_graphs_only_when_asked(monkeypatch, env, expected):
    """Megatron-LM's plain TransformerConfig gets moe_megamoe_cuda_graph from MEGAMOE_CUDA_GRAPH,
    off by default as MegaMoETransformerConfig's (an absent field would read as None: graphs
    wherever possible)."""
    from types import SimpleNamespace

    from megatron_patch.spec import ensure_megamoe_fields

    if env is None:
        monkeypatch.delenv("MEGAMOE_CUDA_GRAPH", raising=False)
    else:
        monkeypatch.setenv("MEGAMOE_CUDA_GRAPH", env)
    assert ensure_megamoe_fields(SimpleNamespace()).moe_megamoe_cuda_graph is expected
    assert ensure_megamoe_fields(SimpleNamespace(moe_megamoe_cuda_graph=True)).moe_megamoe_cuda_graph is True
    monkeypatch.setenv("MEGAMOE_CUDA_GRAPH", "yes please")
    with pytest.raises(ValueError, match="MEGAMOE_CUDA_GRAPH"):
        ensure_megamoe_fields(SimpleNamespace())


def test_executor_report(monkeypatch):
    """Which executor a MoE layer of the config runs (the trainer's first line prints it): the
    reference on a GPU names why (a CUDA device of capability 9.0 monkeypatched; nothing runs)."""
    import torch

    from megatron_patch import describe_megamoe_executor

    pytest.importorskip("triton", reason="the GPU executor's checks import triton_backend")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    fp32 = make(moe_megamoe_recipe="fp8", hidden_size=256, moe_ffn_hidden_size=384, params_dtype=torch.float32)
    assert describe_megamoe_executor(fp32, cuda).startswith("reference (the GPU executor cannot: dtype torch.float32")
    for recipe in ("fp8", "mxfp8_mxfp4"):
        cfg = make(moe_megamoe_recipe=recipe, hidden_size=256, moe_ffn_hidden_size=384, params_dtype=torch.bfloat16)
        assert describe_megamoe_executor(cfg, cuda) == "triton"
    assert describe_megamoe_executor(fp32, torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="'triton' cannot run recipe 'mxfp8_mxfp4'"):
        describe_megamoe_executor(make(moe_megamoe_recipe="mxfp8_mxfp4", moe_megamoe_backend="triton"), cuda)
