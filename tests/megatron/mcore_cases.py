"""What the Megatron adapter tests run on every rank (module-level functions, so the rank pool
can call them by name). Each builds a tiny GPTModel twice, with Megatron's stock MoE layers and
with MegaMoE layers, and compares them."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_mega_moe_dist import rel_err  # the suite's one relative-error helper

_READY = False
VOCAB, SEQ, BATCH = 128, 16, 2


def device() -> torch.device:
    """CUDA under NCCL (GPU runs of the same cases), CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init(rank, world, ep=None):
    """Idempotent per process: CPU shims, Megatron parallel state with EP=ep (default world), RNG tracker."""
    global _READY
    if _READY:
        return
    from megatron_patch import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep or world)
    model_parallel_cuda_manual_seed(1234)
    _READY = True


_CONFIG_KEYS = set()


def config(recipe, **overrides):
    from megatron_patch import MegaMoETransformerConfig

    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        moe_ffn_hidden_size=128,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        expert_model_parallel_size=dist.get_world_size() if dist.is_initialized() else 2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_megamoe_recipe=recipe,
    )
    kw.update(overrides)
    _CONFIG_KEYS.update(k for k in kw if not k.startswith("moe_megamoe"))
    return MegaMoETransformerConfig(**kw)


def model(cfg, seed=0):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_patch import get_megamoe_gpt_decoder_block_spec

    torch.manual_seed(seed)
    return GPTModel(cfg, get_megamoe_gpt_decoder_block_spec(cfg), vocab_size=VOCAB, max_sequence_length=SEQ).to(
        device()
    )


def batch(rank, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens.to(device()), pos.to(device()), labels.to(device())


def pair(overrides, recipe="bf16"):
    """(stock model, MegaMoE model) with identical weights."""
    stock = model(config(None, **overrides), seed=1)
    mega = model(config(recipe, **overrides), seed=2)
    mega.load_state_dict(stock.state_dict(), strict=True)
    return stock, mega


def per_expert(named):
    """{name: tensor} of a MegaMoE model with its stacked expert tensors split into the per-expert
    names of Megatron's SequentialMLP (`experts.fc1_weight` [E_l, 2I, H] ->
    `experts.local_experts.{i}.linear_fc1.weight`), so it compares name by name with a stock model's."""
    out = {}
    for name, t in named.items():
        for fc in (1, 2):
            suffix = f"experts.fc{fc}_weight"
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                for i in range(t.shape[0]):
                    out[f"{base}experts.local_experts.{i}.linear_fc{fc}.weight"] = t[i]
                break
        else:
            out[name] = t
    return out


def moe_layer_types(m):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [type(x).__name__ for x in m.modules() if isinstance(x, MoELayer)]


# ----------------------------------------------------------------------------------------------
def equivalence(rank, world, overrides, bf16=False, tol=1e-5):
    """Same loss and the same gradient for every parameter (router included), stock vs MegaMoE.
    bf16: both models in bf16 (Float16Module, fp32 router), compared within `tol`."""
    init(rank, world)
    from megatron_patch import MegaMoEMoELayer

    if bf16:
        import torch as _t

        overrides = dict(overrides, bf16=True, params_dtype=_t.bfloat16, moe_router_dtype="fp32")
    stock, mega = pair(overrides)
    assert moe_layer_types(stock) == ["MoELayer", "MoELayer"], moe_layer_types(stock)
    assert moe_layer_types(mega) == ["MegaMoEMoELayer", "MegaMoEMoELayer"], moe_layer_types(mega)

    # the same parameters per expert, with the same allreduce flags (expert-DP reduction, optimizer groups)
    def flags(m):
        return {
            e: (getattr(p, "allreduce", True), tuple(t.shape))
            for n, p in m.named_parameters()
            for e, t in per_expert({n: p}).items()
        }

    assert flags(stock) == flags(mega)
    stacked = [n for n, _ in mega.named_parameters() if n.endswith(("experts.fc1_weight", "experts.fc2_weight"))]
    assert len(stacked) == 4 and not any("local_experts" in n for n, _ in mega.named_parameters()), stacked
    tokens, pos, labels = batch(rank)
    out = {}
    for name, m in (("stock", stock), ("mega", mega)):
        m.train()
        if bf16:
            from megatron.core.transformer.module import Float16Module

            m = Float16Module(m.config, m)
        loss = m(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        out[name] = (
            loss.item(),
            per_expert({n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}),
        )
    (l1, g1), (l2, g2) = out["stock"], out["mega"]
    assert set(g1) == set(g2), sorted(set(g1) ^ set(g2))
    errs = {n: rel_err(g2[n], g1[n]) for n in g1}  # stacked grad[e] vs stock expert e's grad
    worst = max(errs, key=errs.get)
    assert abs(l1 - l2) <= tol * abs(l1), (l1, l2)
    assert errs[worst] < tol, (worst, errs[worst])
    router = [n for n in g1 if n.endswith("router.weight")]
    assert router and all(g1[n].abs().max() > 0 for n in router)
    mega_layers = [m for m in mega.modules() if isinstance(m, MegaMoEMoELayer)]
    return {
        "loss": (l1, l2),
        "worst": (worst, errs[worst]),
        "n_grads": len(g1),
        "stats": [m.expert_recv_stats.tolist() for m in mega_layers],
        "graphed": [m.megamoe.graphed is not None for m in mega_layers],
    }


def expert_load(rank, world, overrides=None):
    """get_expert_load == tokens per local expert counted from the router's routing_map
    (with activation recompute: counted once, not again in the recompute pass)."""
    init(rank, world)
    from megatron_patch import get_expert_load

    _, mega = pair(overrides or {})
    routing = []
    hooks = [
        r.register_forward_hook(lambda mod, i, o: routing.append(o[1].detach().clone()))
        for r in (l.mlp.router for l in mega.decoder.layers)
    ]
    assert get_expert_load(mega, reset=True).sum() == 0
    tokens, pos, labels = batch(rank, seed=3)
    expected = torch.zeros(2, 4, dtype=torch.int64, device=device())
    for step in range(2):
        mega.train()
        mega(tokens, pos, None, labels=labels).float().mean().backward()
    for h in hooks:
        h.remove()
    recomputed = {  # layers whose router runs again in backward
        None: [],
        "selective": [0, 1],
        "uniform": [0, 1],
        "block": list(range((overrides or {}).get("recompute_num_layers", 0))),
    }[(overrides or {}).get("recompute_method") or (overrides or {}).get("recompute_granularity")]
    per_step = 2 + len(recomputed)
    assert len(routing) == 2 * per_step, len(routing)
    routing = [rm for i, rm in enumerate(routing) if i % per_step < 2]  # each step: fwd L0, fwd L1, recompute ...
    for i, rm in enumerate(routing):
        expected[i % 2] += rm.sum(0).long()
    dist.all_reduce(expected)  # rows each expert receives from all ranks
    E_l = 2
    mine = expected[:, rank * E_l : (rank + 1) * E_l]
    load = get_expert_load(mega, reset=True)
    assert load.dtype == torch.int64 and tuple(load.shape) == (2, E_l), load.shape
    assert torch.equal(load, mine), (load, mine)
    assert get_expert_load(mega).sum() == 0  # reset
    assert get_expert_load([mega]).shape == (2, E_l)  # list of model chunks
    return load.tolist()


def sharded_layout(m):
    """What a dist checkpoint of model m holds on this rank: for every sharded tensor / object
    (factories built), its checkpoint key, global shape and offset, fragmentation and replica id."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = []
    for v in m.sharded_state_dict().values():
        for t in v.build() if isinstance(v, ShardedTensorFactory) else [v]:
            if isinstance(t, ShardedTensor):
                out.append(
                    (t.key, t.global_shape, t.global_offset, t.axis_fragmentations, t.replica_id, tuple(t.local_shape))
                )
            elif isinstance(t, ShardedObject):
                out.append((t.key, t.global_shape, t.global_offset, None, t.replica_id, None))
    return sorted(out, key=repr)


def te_grouped_naming(state_dict):
    """A SequentialMLP-named state dict renamed the way TEGroupedMLP names its weights
    (`experts.linear_fc1.weight{i}`; TE is not installed here to build one)."""
    import re

    out = {}
    for k, v in state_dict.items():
        m = re.match(r"(.*experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$", k)
        if m is None:
            out[k] = v
        elif m.group(4) == "weight":
            out[f"{m.group(1)}{m.group(3)}.weight{m.group(2)}"] = v
        else:
            out[f"{m.group(1)}{m.group(3)}._extra_state"] = None
    return out


def checkpoint_roundtrip(rank, world, ckpt_dir, overrides):
    """stock -> MegaMoE and MegaMoE -> stock, bit-exact: through megatron.core.dist_checkpointing
    (same checkpoint keys, offsets and replica ids per expert) and through the plain state_dict
    (SequentialMLP keys, and TEGroupedMLP keys)."""
    init(rank, world)
    from megatron.core import dist_checkpointing

    stock = model(config(None, **overrides), seed=11)
    mega = model(config("bf16", **overrides), seed=12)

    def params(m):
        return per_expert({n: p.detach().clone() for n, p in m.named_parameters()})

    def save(m, path):
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(m.sharded_state_dict(), path)
        dist.barrier()

    def load(m, path):
        sd = dist_checkpointing.load(m.sharded_state_dict(), path)
        m.load_state_dict(sd, strict=True)

    def same(a, b):
        assert set(a) == set(b), sorted(set(a) ^ set(b))
        bad = [n for n in a if not torch.equal(a[n], b[n])]
        assert not bad, bad

    assert sharded_layout(stock) == sharded_layout(mega)
    ref_stock, ref_mega = params(stock), params(mega)
    assert any(not torch.equal(ref_stock[n], ref_mega[n]) for n in ref_stock)  # different inits
    # stock -> MegaMoE
    save(stock, os.path.join(ckpt_dir, "stock"))
    load(mega, os.path.join(ckpt_dir, "stock"))
    same(params(mega), ref_stock)
    # MegaMoE (with its own weights) -> stock
    fresh = model(config("bf16", **overrides), seed=13)
    ref_fresh = params(fresh)
    save(fresh, os.path.join(ckpt_dir, "mega"))
    load(stock, os.path.join(ckpt_dir, "mega"))
    same(params(stock), ref_fresh)

    # plain state_dict: the same keys as stock's, loadable both ways (strict)
    stock = model(config(None, **overrides), seed=21)
    mega = model(config("bf16", **overrides), seed=22)
    assert list(mega.state_dict().keys()) == list(stock.state_dict().keys())
    ref_stock, ref_mega = params(stock), params(mega)
    mega.load_state_dict(stock.state_dict(), strict=True)
    same(params(mega), ref_stock)
    stock.load_state_dict(model(config("bf16", **overrides), seed=22).state_dict(), strict=True)
    same(params(stock), ref_mega)
    # TEGroupedMLP naming into MegaMoE
    mega = model(config("bf16", **overrides), seed=23)
    te_sd = te_grouped_naming(model(config(None, **overrides), seed=24).state_dict())
    assert any(".experts.linear_fc1.weight1" in k for k in te_sd)
    mega.load_state_dict(te_sd, strict=True)
    same(params(mega), params(model(config(None, **overrides), seed=24)))
    return len(ref_stock)


def expert_bias_training(
    rank, world, steps=2, distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False
):
    """Sigmoid router + aux-loss-free expert bias with DDP, finalize_model_grads and the Megatron
    optimizer: the bias (and the router's token counts) evolve exactly as with stock layers.
    Optionally with the distributed optimizer and overlapped grad reduction (DDP's grad hooks must
    fire through the stacked weights)."""
    init(rank, world)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    overrides = dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-2,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
    )
    stock, mega = pair(overrides)
    results = {}
    for name, m in (("stock", stock), ("mega", mega)):
        cfg = m.config
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=distributed_optimizer,
            overlap_param_gather=overlap_param_gather,
        )
        ddp = DistributedDataParallel(cfg, ddp_cfg, m)
        synced = []  # DDP's param-sync pre-hook must run on the module that owns the stacked weights
        for x in m.modules():
            if type(x).__name__ == "MegaMoEExperts":
                x.register_forward_pre_hook(lambda mod, args: synced.append(mod))
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=1e-2, bf16=False, fp16=False, use_distributed_optimizer=distributed_optimizer
        )
        opt = get_megatron_optimizer(opt_cfg, [ddp])
        losses, biases, counts = [], [], []
        for step in range(steps):
            tokens, pos, labels = batch(rank, seed=10 + step)
            ddp.zero_grad_buffer()
            opt.zero_grad()
            loss = ddp(tokens, pos, None, labels=labels).float().mean()
            loss.backward()
            counts.append([l.mlp.router.local_tokens_per_expert.clone() for l in m.decoder.layers])
            finalize_model_grads([ddp])
            ok, _, _ = opt.step()
            assert ok
            losses.append(loss.item())
            biases.append([l.mlp.router.expert_bias.detach().clone() for l in m.decoder.layers])
            assert len(synced) == (2 * (step + 1) if name == "mega" else 0), len(synced)
        results[name] = (losses, biases, counts, per_expert({n: p.detach().clone() for n, p in m.named_parameters()}))
    (l1, b1, c1, p1), (l2, b2, c2, p2) = results["stock"], results["mega"]
    for s in range(steps):
        assert abs(l1[s] - l2[s]) <= 1e-5 * abs(l1[s]), (s, l1[s], l2[s])
        for a, b in zip(c1[s], c2[s]):
            assert torch.equal(a, b), (s, a, b)
        for a, b in zip(b1[s], b2[s]):
            assert torch.equal(a, b), (s, a, b)
    assert any(b.abs().sum() > 0 for b in b1[-1])  # the bias did move
    worst = max(rel_err(p2[n], p1[n]) for n in p1)
    assert worst < 1e-4, worst
    return {"losses": (l1, l2), "bias": [b.tolist() for b in b2[-1]], "param_rel": worst}


def spec_paths(rank, world):
    """The uncalled spec object (Megatron-LM `--spec megatron_patch.spec
    get_megamoe_gpt_decoder_block_spec`) builds the same model as the called one, also with
    dense layers mixed in (moe_layer_freq) and with the recipe off."""
    init(rank, world)
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import import_module

    from megatron_patch import get_megamoe_gpt_decoder_block_spec

    spec_obj = import_module(("megatron_patch.spec", "get_megamoe_gpt_decoder_block_spec"))
    assert spec_obj is get_megamoe_gpt_decoder_block_spec
    out = {}
    for recipe in ("bf16", None):
        for freq in (1, [0, 1]):
            cfg = config(recipe, moe_layer_freq=freq)
            called = GPTModel(
                cfg, get_megamoe_gpt_decoder_block_spec(cfg), vocab_size=VOCAB, max_sequence_length=SEQ
            ).to(device())
            uncalled = GPTModel(cfg, spec_obj, vocab_size=VOCAB, max_sequence_length=SEQ)
            t1, t2 = moe_layer_types(called), moe_layer_types(uncalled)
            assert t1 == t2, (t1, t2)
            n1 = [(n, tuple(p.shape)) for n, p in called.named_parameters()]
            n2 = [(n, tuple(p.shape)) for n, p in uncalled.named_parameters()]
            assert n1 == n2
            assert sorted(called.sharded_state_dict().keys()) == sorted(uncalled.sharded_state_dict().keys())
            out[f"{recipe}-{freq}"] = t1
    assert out["bf16-1"] == ["MegaMoEMoELayer"] * 2 and out["None-1"] == ["MoELayer"] * 2
    assert out["bf16-[0, 1]"] == ["MegaMoEMoELayer"]
    # Megatron-LM's plain TransformerConfig (no moe_megamoe_* fields): the uncalled spec means MegaMoE
    from megatron.core.transformer.transformer_config import TransformerConfig

    plain_kw = {f: getattr(config("bf16"), f) for f in TransformerConfig.__dataclass_fields__ if f in _CONFIG_KEYS}
    plain = TransformerConfig(**plain_kw)
    assert not hasattr(plain, "moe_megamoe_recipe")
    os.environ.pop("MEGAMOE_RECIPE", None)
    m = GPTModel(plain, spec_obj, vocab_size=VOCAB, max_sequence_length=SEQ)
    assert moe_layer_types(m) == ["MegaMoEMoELayer"] * 2 and plain.moe_megamoe_recipe == "bf16"
    plain = TransformerConfig(**plain_kw)
    os.environ["MEGAMOE_RECIPE"] = "none"
    try:
        assert moe_layer_types(GPTModel(plain, spec_obj, vocab_size=VOCAB, max_sequence_length=SEQ)) == ["MoELayer"] * 2
    finally:
        del os.environ["MEGAMOE_RECIPE"]
    # and it still trains one step through the uncalled spec
    cfg = config("bf16")
    m = GPTModel(cfg, spec_obj, vocab_size=VOCAB, max_sequence_length=SEQ).to(device())
    tokens, pos, labels = batch(rank)
    m(tokens, pos, None, labels=labels).float().mean().backward()
    return out


def megakernel_backend(rank, world):
    """register_megakernel_backend() against a stand-in for upstream Megatron's megakernel
    factory (megatron-core 0.19.2 has none): "megamoe" builds our backend, whose forward equals the
    stock MoELayer's (routed + shared experts); other names still reach the original factory."""
    init(rank, world)
    import sys
    import types

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_patch import megakernel

    pkg = "megatron.core.transformer.moe.megakernel"

    class MegakernelBackend(torch.nn.Module):
        def forward(self, hidden_states, probs, routing_map):
            raise NotImplementedError

    def build_megakernel_backend(*, config, ep_group, routed_experts, shared_experts, num_local_experts):
        raise ValueError(f"Unsupported MoE megakernel backend: {config.moe_megakernel_backend!r}")

    fake = {
        pkg: types.ModuleType(pkg),
        pkg + ".backend": types.ModuleType(pkg + ".backend"),
        pkg + ".factory": types.ModuleType(pkg + ".factory"),
    }
    fake[pkg].__path__ = []
    fake[pkg + ".backend"].MegakernelBackend = MegakernelBackend
    fake[pkg + ".factory"].build_megakernel_backend = build_megakernel_backend
    sys.modules.update(fake)
    try:
        assert megakernel.register_megakernel_backend() is True
        factory = fake[pkg + ".factory"]
        cfg = config(None, num_layers=1, moe_shared_expert_intermediate_size=96)
        stock = get_moe_module_spec(use_te=False, num_experts=4)(config=cfg, layer_number=1).to(device())
        stock.set_layer_number(1)
        cfg.moe_megakernel_backend = "megamoe"
        be = factory.build_megakernel_backend(
            config=cfg,
            ep_group=stock.ep_group,
            routed_experts=stock.experts,
            shared_experts=stock.shared_experts,
            num_local_experts=stock.num_local_experts,
        )
        assert isinstance(be, MegakernelBackend) and not list(be.parameters())  # native modules own the weights
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(SEQ, BATCH, 64, generator=g).to(device())
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_stock, _ = stock(x1)
        probs, routing_map = stock.route(x2)
        # the backend reads the native modules' weights without calling them: their forward pre-hooks
        # (where Megatron DDP waits for the distributed optimizer's param all-gather) run once per call
        owners = [
            m
            for m in (*stock.experts.modules(), *stock.shared_experts.modules())
            if next(m.parameters(recurse=False), None) is not None
        ]
        fired = []
        hooks = [m.register_forward_pre_hook(lambda mod, args: fired.append(mod)) for m in owners]
        y_be = be(x2, probs, routing_map)
        for h in hooks:
            h.remove()
        assert len(owners) == 2 * (stock.num_local_experts + 1) and sorted(map(id, fired)) == sorted(map(id, owners)), (
            len(owners),
            len(fired),
        )
        assert rel_err(y_be.detach(), y_stock.detach()) < 1e-5
        y_stock.sum().backward()
        y_be.sum().backward()
        assert rel_err(x2.grad, x1.grad) < 1e-5
        cfg.moe_megakernel_backend = "mok"
        try:
            factory.build_megakernel_backend(
                config=cfg, ep_group=None, routed_experts=None, shared_experts=None, num_local_experts=2
            )
        except ValueError as e:
            assert "'mok'" in str(e)
        else:
            raise AssertionError("other backend names must reach the original factory")
    finally:
        for name in fake:
            sys.modules.pop(name, None)
        megakernel._registered = False
    return True


def quantized_recipe(rank, world, recipe):
    """fp8 / mxfp8_mxfp4 recipes in the GPT model: close to the stock fp32 model (quantization
    error only: e4m3 activations ~6% per element, e2m1 weights up to ~25%), every gradient finite."""
    init(rank, world)
    overrides = dict(
        hidden_size=128, ffn_hidden_size=128, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=128
    )
    stock, mega = pair(overrides, recipe=recipe)
    tokens, pos, labels = batch(rank)
    out = {}
    for name, m in (("stock", stock), ("mega", mega)):
        loss = m(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        out[name] = (
            loss.item(),
            per_expert({n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}),
        )
    (l1, g1), (l2, g2) = out["stock"], out["mega"]
    assert abs(l1 - l2) < 1e-2 * abs(l1), (l1, l2)
    assert all(torch.isfinite(g).all() for g in g2.values())
    errs = {n: rel_err(g2[n], g1[n]) for n in g1}
    worst = max(errs, key=errs.get)
    assert errs[worst] < {"fp8": 0.2, "mxfp8_mxfp4": 0.5}[recipe], (worst, errs[worst])
    return {"loss": (l1, l2), "worst": (worst, errs[worst])}


def _recording_transform():
    """Wrap megamoe_train.weights._transform (the uncached weight transform); returns (calls, undo)."""
    import megamoe_train.weights as W

    orig, calls = W._transform, []

    def recording(w1, w2, cfg):
        out = orig(w1, w2, cfg)
        calls.append((w1, w2, cfg, out))
        return out

    W._transform = recording
    return calls, orig, lambda: setattr(W, "_transform", orig)


def weight_transform_once_per_step(rank, world, steps=3, micro_batches=2):
    """fp8 recipe, bf16 model under Megatron's mixed-precision optimizer (which writes the model
    params through `.data`), DDP, full activation recompute, 2 micro-batches per step: each layer's
    expert weights are quantized exactly once per optimizer step (not per micro-batch, not again in
    the recompute pass), and the quantized weights a step uses are those of the updated parameters."""
    init(rank, world)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_patch.experts import MegaMoEExperts

    overrides = dict(
        hidden_size=128,
        ffn_hidden_size=128,
        moe_ffn_hidden_size=128,
        bf16=True,
        params_dtype=torch.bfloat16,
        moe_router_dtype="fp32",
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    cfg = config("fp8", **overrides)
    m = Float16Module(cfg, model(cfg, seed=5))
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), m)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True), [ddp])
    experts = [x for x in ddp.modules() if isinstance(x, MegaMoEExperts)]
    assert len(experts) == 2
    calls, transform, undo = _recording_transform()
    try:
        previous = None
        for step in range(steps):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            for micro in range(micro_batches):
                tokens, pos, labels = batch(rank, seed=20 + step * micro_batches + micro)
                ddp(tokens, pos, None, labels=labels).float().mean().backward()
            # one transform per layer this step, of that layer's own stacked parameters
            assert len(calls) == len(experts) * (step + 1), (step, len(calls))
            used = calls[-len(experts) :]
            assert sorted(c[0].data_ptr() for c in used) == sorted(e.fc1_weight.data_ptr() for e in experts)
            for w1, w2, mm_cfg, out in used:  # the quantized weights are those of the current parameters
                fresh = transform(w1.detach(), w2.detach(), mm_cfg)
                assert out.quantized and out.w1.data_ptr() != w1.data_ptr()  # fp8: a quantized copy
                assert torch.equal(out.w1.float(), fresh.w1.float()) and torch.equal(out.w1_scales, fresh.w1_scales)
                assert torch.equal(out.w2.float(), fresh.w2.float()) and torch.equal(out.w2_scales, fresh.w2_scales)
            if previous is not None:  # and the optimizer did change them
                assert any(not torch.equal(a.w1.float(), b[3].w1.float()) for a, b in zip(previous, used))
            previous = [c[3] for c in used]
            finalize_model_grads([ddp])
            versions = [e.fc1_weight._version for e in experts]
            ok, _, _ = opt.step()
            assert ok
            assert all(e.fc1_weight._version > v for e, v in zip(experts, versions))  # the step hook's mark
    finally:
        undo()
    return len(calls)


def forward_reads_parameters(rank, world):
    """bf16 recipe: mega_moe gets the stacked parameters themselves, and their transform is the
    parameter storage (no copy) when the model dtype is the compute dtype (fp32 here, and bf16
    under Float16Module); no per-forward stack of expert weights."""
    init(rank, world)
    from megatron.core.transformer.module import Float16Module

    import megamoe_train.autograd as A
    from megatron_patch.experts import MegaMoEExperts

    seen = []
    orig_apply = A.MegaMoEFunction.apply

    def spy(x, topk_idx, topk_weights, w1, w2, *rest):
        seen.append((w1, w2))
        return orig_apply(x, topk_idx, topk_weights, w1, w2, *rest)

    calls, _, undo = _recording_transform()
    A.MegaMoEFunction.apply = spy
    try:
        for bf16 in (False, True):
            kw = dict(bf16=True, params_dtype=torch.bfloat16, moe_router_dtype="fp32") if bf16 else {}
            cfg = config("bf16", **kw)
            m = model(cfg, seed=6)
            if bf16:
                m = Float16Module(cfg, m)
            experts = [x for x in m.modules() if isinstance(x, MegaMoEExperts)]
            seen.clear(), calls.clear()
            tokens, pos, labels = batch(rank)
            m(tokens, pos, None, labels=labels).float().mean().backward()
            assert [(a is e.fc1_weight, b is e.fc2_weight) for (a, b), e in zip(seen, experts)] == [(True, True)] * 2
            assert len(calls) == 2
            for (w1, w2, _, out), e in zip(calls, experts):
                assert out.w1.data_ptr() == e.fc1_weight.data_ptr() and out.w2.data_ptr() == e.fc2_weight.data_ptr()
                assert out.w1.dtype == (torch.bfloat16 if bf16 else torch.float32)
            assert all(e.fc1_weight.grad is not None and e.fc1_weight.grad.abs().sum() > 0 for e in experts)
    finally:
        A.MegaMoEFunction.apply = orig_apply
        undo()
    return True


def local_hybrid_stack_spec(num_experts):
    """A HybridModel stack spec of attention ('*') and MoE ('E') layers from megatron-core's
    local modules: megatron-core's own `hybrid_stack_spec` needs Transformer Engine (TENorm,
    TE linears and attention) and its Mamba layers need mamba_ssm, neither installed here."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    local = get_gpt_layer_local_spec().submodules
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=local.input_layernorm,
            self_attention=local.self_attention,
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    moe = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=local.pre_mlp_layernorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=num_experts),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(attention_layer=attention, moe_layer=moe))


def hybrid_equivalence(rank, world, tol=1e-5):
    """HybridModel (layer pattern '*E*E') with its MoE layers switched through
    get_megamoe_hybrid_stack_spec: same output and gradients (per expert) as the stock HybridModel,
    and its checkpoint keys equal stock's. Built with post_process=False: HybridStack's final norm
    is always TENorm, which needs Transformer Engine; the loss is a fixed random projection of the
    stack's output."""
    init(rank, world)
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_patch import get_megamoe_hybrid_stack_spec, get_megamoe_moe_module_spec

    # no aux / z-loss: Megatron's global aux-loss tracker is sized by the first model's layer
    # count (2 in the other cases of this process); the GPT cases cover the losses
    overrides = dict(
        num_layers=4,
        moe_shared_expert_intermediate_size=96,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
    )
    models = {}
    for name, recipe, seed in (("stock", None, 1), ("mega", "bf16", 2)):
        cfg = config(recipe, **overrides)
        spec = get_megamoe_hybrid_stack_spec(cfg, local_hybrid_stack_spec(cfg.num_moe_experts))
        torch.manual_seed(seed)
        models[name] = HybridModel(
            cfg,
            spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            hybrid_layer_pattern="*E*E",
            position_embedding_type="rope",
            post_process=False,
        ).to(device())
    stock, mega = models["stock"], models["mega"]
    assert moe_layer_types(stock) == ["MoELayer"] * 2 and moe_layer_types(mega) == ["MegaMoEMoELayer"] * 2
    assert sharded_layout(stock) == sharded_layout(mega)
    mega.load_state_dict(stock.state_dict(), strict=True)
    tokens, pos, _ = batch(rank)
    proj = torch.randn(SEQ, BATCH, 64, generator=torch.Generator().manual_seed(7 + rank)).to(device())
    out = {}
    for name, m in (("stock", stock), ("mega", mega)):
        hidden = m(tokens, pos, None)
        assert hidden.shape == proj.shape, hidden.shape
        loss = (hidden.float() * proj).mean()
        loss.backward()
        out[name] = (
            hidden.detach().clone(),
            per_expert({n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}),
        )
    (h1, g1), (h2, g2) = out["stock"], out["mega"]
    assert set(g1) == set(g2), sorted(set(g1) ^ set(g2))
    errs = {n: rel_err(g2[n], g1[n]) for n in g1}
    worst = max(errs, key=errs.get)
    assert rel_err(h2, h1) <= tol, rel_err(h2, h1)
    assert errs[worst] < tol, (worst, errs[worst])
    assert any("router" in n for n in g1) and any("experts.local_experts" in n for n in g1)
    l1 = rel_err(h2, h1)
    # the uncalled form (Megatron-LM's hybrid `--spec`): the MoE layer is chosen by the config it is built with
    from megatron.core.transformer.spec_utils import import_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patch.spec import hybrid_stack_spec_by_config

    by_config = hybrid_stack_spec_by_config(local_hybrid_stack_spec(4))
    build = lambda cfg: HybridModel(
        cfg,
        by_config,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        hybrid_layer_pattern="*E*E",
        position_embedding_type="rope",
        post_process=False,
    )
    assert moe_layer_types(build(config("bf16", **overrides))) == ["MegaMoEMoELayer"] * 2
    assert moe_layer_types(build(config(None, **overrides))) == ["MoELayer"] * 2
    plain_kw = {
        f: getattr(config("bf16", **overrides), f) for f in TransformerConfig.__dataclass_fields__ if f in _CONFIG_KEYS
    }
    os.environ["MEGAMOE_RECIPE"] = "none"
    try:
        assert moe_layer_types(build(TransformerConfig(**plain_kw))) == ["MoELayer"] * 2
    finally:
        del os.environ["MEGAMOE_RECIPE"]
    plain = TransformerConfig(**plain_kw)
    assert moe_layer_types(build(plain)) == ["MegaMoEMoELayer"] * 2 and plain.moe_megamoe_recipe == "bf16"
    spec = import_module(
        ("megatron_patch.hybrid_spec", "megamoe_hybrid_stack_spec")
    )  # megatron-core's TE stack, swapped
    assert spec.submodules.moe_layer.submodules.mlp.func.__name__ == "moe_layer_by_config"
    # the MoE builder alone, as hybrid_layer_specs calls it
    cfg = config("bf16")
    assert get_megamoe_moe_module_spec(cfg, use_te=False, num_experts=4).func.__name__ == "MegaMoEMoELayer"
    assert get_megamoe_moe_module_spec(config(None), use_te=False, num_experts=4).func.__name__ == "MoELayer"
    return {"out_rel_err": l1, "worst": (worst, errs[worst]), "n_grads": len(g1)}


def optimizer_checkpoint_both_ways(rank, world, ckpt_dir):
    """Adam state through dist checkpoints: after one identical step, the MegaMoE model's optimizer
    sharded state has the stock model's keys and layout (per expert), and a MegaMoE checkpoint of
    model + optimizer loads into a stock model + optimizer (and back) with equal moments per expert."""
    init(rank, world)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    def trained(recipe, seed_model):
        m = model(config(recipe), seed=seed_model)
        ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), m)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [ddp])
        return m, ddp, opt

    def step(m, ddp, opt, seed):
        ddp.zero_grad_buffer(), opt.zero_grad()
        tokens, pos, labels = batch(rank, seed=seed)
        ddp(tokens, pos, None, labels=labels).float().mean().backward()
        finalize_model_grads([ddp])  # data-parallel grads reduced: replicated state equal on every rank
        assert opt.step()[0]

    def layout(m, opt):
        out = []
        for v in nested_values(opt.sharded_state_dict(m.sharded_state_dict())):
            for t in v.build() if isinstance(v, ShardedTensorFactory) else [v]:
                if isinstance(t, ShardedTensor):
                    out.append((t.key, t.global_shape, t.global_offset, t.axis_fragmentations, t.replica_id))
        return sorted(out, key=repr)

    def moments(m, opt):
        """{param name (per expert): exp_avg} of a model."""
        inner = opt.chained_optimizers if hasattr(opt, "chained_optimizers") else [opt]
        named = {id(p): n for n, p in m.named_parameters()}
        out = {}
        for o in inner:
            for group in o.optimizer.param_groups:
                for p in group["params"]:
                    out.update(per_expert({named[id(p)]: o.optimizer.state[p]["exp_avg"].clone()}))
        return out

    def save(m, opt, path):
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        model_sd = m.sharded_state_dict()
        dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}, path)
        dist.barrier()

    def load(m, opt, path):  # as megatron_patch/checkpoint.py does
        model_sd = m.sharded_state_dict()
        m.load_state_dict(dist_checkpointing.load({"model": model_sd}, path)["model"], strict=True)
        model_sd = m.sharded_state_dict()
        opt.load_state_dict(
            dist_checkpointing.load({"optimizer": opt.sharded_state_dict(model_sd, is_loading=True)}, path)["optimizer"]
        )

    stock, s_ddp, s_opt = trained(None, 31)
    mega, m_ddp, m_opt = trained("bf16", 32)
    mega.load_state_dict(stock.state_dict(), strict=True)
    step(stock, s_ddp, s_opt, 40), step(mega, m_ddp, m_opt, 40)
    assert layout(stock, s_opt) == layout(mega, m_opt)
    ref_s, ref_m = moments(stock, s_opt), moments(mega, m_opt)
    assert max(rel_err(ref_m[n], ref_s[n]) for n in ref_s) < 1e-4  # same step, same moments
    # MegaMoE -> a fresh stock run, and stock -> a fresh MegaMoE run
    save(mega, m_opt, os.path.join(ckpt_dir, "mega"))
    save(stock, s_opt, os.path.join(ckpt_dir, "stock"))
    for recipe, src, ref in ((None, "mega", ref_m), ("bf16", "stock", ref_s)):
        m, ddp, opt = trained(recipe, 50)
        step(m, ddp, opt, 41)  # optimizer state exists, and differs
        load(m, opt, os.path.join(ckpt_dir, src))
        got = moments(m, opt)
        assert set(got) == set(ref), sorted(set(got) ^ set(ref))
        bad = [n for n in ref if not torch.equal(got[n], ref[n])]
        assert not bad, bad
    return len(ref_s)


def expert_main_grad_overwrite(
    rank, world, steps=2, micro_batches=2, distributed_optimizer=False, overlap_grad_reduce=False
):
    """megatron_patch.grad_buffers: a DDP model whose grad-buffer reset skips the fused expert
    weights' main_grad (flagging them to be written over) gives the main_grads of one that zeroes
    everything, bit for bit, at every step, though its expert main_grads hold NaN before each
    step; the rest of its buffers is still zeroed. A step without a backward gets zeros from the
    finish_grad_sync safety net. Optionally with the distributed optimizer's buffers and DDP's
    overlapped reduction (buckets reduced from the backward's hooks)."""
    init(rank, world)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_patch.grad_buffers import fused_expert_weights, overwrite_expert_main_grads

    cfg = config("bf16", moe_megamoe_fuse_wgrad_accumulation=True, moe_shared_expert_intermediate_size=64)
    ddps = []
    for _ in range(2):
        m = model(cfg, seed=7)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=distributed_optimizer,
        )
        ddps.append(DistributedDataParallel(cfg, ddp_cfg, m))
    switched, plain = ddps
    assert overwrite_expert_main_grads(switched) == 4  # 2 MoE layers x (fc1, fc2)
    assert overwrite_expert_main_grads(switched) == 4  # idempotent
    experts = fused_expert_weights(switched.module)
    others = [p for p in switched.module.parameters() if p.requires_grad and all(p is not e for e in experts)]

    def grads(ddp):
        return [p.main_grad.clone() for p in ddp.module.parameters() if p.requires_grad]

    # a last step without a backward (the safety net), where megatron allows one: with overlapped
    # reduction its finish_grad_sync requires every bucket's reduction issued by the backward
    for step in range(steps + (0 if overlap_grad_reduce else 1)):
        for p in experts:  # stale values from "earlier steps": never to be read
            p.main_grad.fill_(float("nan"))
        for p in others:
            p.main_grad.fill_(float("nan"))
        for ddp in ddps:
            ddp.zero_grad_buffer()
        assert all(p.overwrite_main_grad for p in experts)
        assert all(not p.main_grad.isnan().any() and not p.main_grad.any() for p in others)  # zeroed
        if step < steps:
            for ddp in ddps:
                for micro in range(micro_batches):
                    tokens, pos, labels = batch(rank, seed=40 + step * micro_batches + micro)
                    ddp(tokens, pos, None, labels=labels).float().mean().backward()
            assert not any(p.overwrite_main_grad for p in experts)  # used up by the first backward
        for ddp in ddps:  # the last step has no backward: the safety net zeroes the flagged weights
            finalize_model_grads([ddp])
        got, want = grads(switched), grads(plain)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        if step == steps:  # no backward: zeros
            assert not any(p.main_grad.any() for p in experts)
        else:
            assert all(p.main_grad.abs().sum() > 0 for p in experts)
    return True


def shared_expert_param_gather(rank, world, recipe, bucket_size=4096, steps=3):
    """With the distributed optimizer's overlap_param_gather, DDP waits for a bucket's parameter
    all-gather in the forward pre-hooks of the modules that own them. mega_moe reads the shared
    experts' weights without calling their modules, so MegaMoECall runs those modules' pre-hooks
    first (before that fix it read them mid all-gather where a bucket held shared-expert weights
    and nothing called before mega_moe, and megatron asserted at the next step's dispatch).
    Buckets small enough to separate them; the same losses as without the overlap; stock layers
    (recipe None) call linear_fc1/fc2 themselves."""
    init(rank, world)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import megatron_patch.moe_layer as moe_layer

    def run(overlap_param_gather):
        cfg = config(recipe, moe_shared_expert_intermediate_size=64)
        m = model(cfg, seed=3)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            use_distributed_optimizer=True,
            overlap_param_gather=overlap_param_gather,
            bucket_size=bucket_size,
        )
        ddp = DistributedDataParallel(cfg, ddp_cfg, m)
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, bf16=False, fp16=False, use_distributed_optimizer=True), [ddp]
        )
        in_flight = []  # shared-expert weights read by mega_moe before their all-gather finished
        real = moe_layer.mega_moe

        def spy(*args, **kwargs):
            for w in (kwargs.get("shared_w1"), kwargs.get("shared_w2")):
                group = ddp.param_to_bucket_group.get(w)
                if overlap_param_gather and group is not None and group.param_gather_handle is not None:
                    in_flight.append(tuple(w.shape))
            return real(*args, **kwargs)

        moe_layer.mega_moe = spy
        losses = []
        try:
            for step in range(steps):
                tokens, pos, labels = batch(rank, seed=10 + step)
                ddp.zero_grad_buffer()
                opt.zero_grad()
                loss = ddp(tokens, pos, None, labels=labels).float().mean()
                loss.backward()
                finalize_model_grads([ddp])
                assert opt.step()[0]
                losses.append(loss.item())
        finally:
            moe_layer.mega_moe = real
        return losses, in_flight

    want, _ = run(False)
    got, in_flight = run(True)
    assert not in_flight, f"mega_moe read shared-expert weights {in_flight} while their all-gather was in flight"
    assert got == want, (got, want)
    return True
