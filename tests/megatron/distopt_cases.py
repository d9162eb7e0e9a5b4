"""What test_distopt_checkpoint runs on every rank: distributed-optimizer checkpoints saved by a
model with stock MoE layers and loaded by one with MegaMoE layers, and the reverse, in each
format Megatron's DistributedOptimizer writes. 4 gloo processes: EP=2, so the experts are
data-parallel too (expert-DP 2) and the optimizer shards every expert weight over 2 ranks."""

from __future__ import annotations

import os
from dataclasses import replace

import mcore_cases
import torch
import torch.distributed as dist
from mcore_cases import batch, config, model
from test_mega_moe_dist import rel_err

EP = 2


def init(rank, world):
    mcore_cases.init(rank, world, ep=EP)


def trained(recipe, seed, bucket_size, bf16=False):
    """A model (stock: recipe None), its DDP and distributed Adam, after one step on batch `seed`.
    bf16: a bf16 model (Float16Module) whose optimizer keeps fp32 master weights of its own."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    precision = dict(bf16=True, params_dtype=torch.bfloat16, moe_router_dtype="fp32") if bf16 else {}
    cfg = config(recipe, expert_model_parallel_size=EP, moe_shared_expert_intermediate_size=64, **precision)
    m = model(cfg, seed=seed)
    if bf16:
        m = Float16Module(cfg, m)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=True,
        overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(m.config, ddp_cfg, m)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=bf16, use_distributed_optimizer=True)
    opt = get_megatron_optimizer(opt_cfg, [ddp])
    step(ddp, opt, seed)
    return m, ddp, opt


def step(ddp, opt, seed):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp.zero_grad_buffer(), opt.zero_grad()
    tokens, pos, labels = batch(dist.get_rank(), seed=seed)
    ddp(tokens, pos, None, labels=labels).float().mean().backward()
    finalize_model_grads([ddp])
    assert opt.step()[0]


def _full(opt, model_param):
    """The optimizer's DP-sharded state of one parameter, gathered: {key: tensor of its shape}.
    A rank whose shard holds none of the parameter contributes zeros."""
    local = id(model_param) in {id(p) for p in opt.model_param_group_index_map}
    tensors = opt._get_main_param_and_optimizer_states(model_param) if local else {}
    out = {}
    for k in ("param", "exp_avg", "exp_avg_sq"):
        full = torch.zeros(model_param.numel(), dtype=torch.float32)
        if local:
            range_map = opt._get_model_param_range_map(model_param)["param"]
            full[range_map.start : range_map.end] = tensors[k].detach()
        dist.all_reduce(full, group=opt.data_parallel_group)  # the shards are disjoint: a sum gathers
        out[k] = full.view(model_param.shape)
    return out


def by_checkpoint_key(m, opt) -> dict:
    """{(state, checkpoint key, global offset): tensor} of this rank: the model's parameters
    ("model") and the optimizer's fp32 master weights and Adam moments, gathered over the data-
    parallel ranks, each split as the model's dist checkpoint splits its parameter (per expert,
    fc1 in gate and up halves), so a stock and a MegaMoE model compare entry by entry."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    sharded = {}
    for v in nested_values(m.sharded_state_dict()):
        if isinstance(v, (ShardedTensor, ShardedTensorFactory)):
            sharded[id(v.data)] = v
    out = {}

    def add(name, meta, data):
        if isinstance(meta, ShardedTensorFactory):
            built = replace(meta, data=data).build()
        else:  # the fp32 state of a bf16 parameter: its dtype too
            built = [replace(meta, data=data, dtype=data.dtype)]
        for t in built:
            out[(name, t.key, t.global_offset)] = t.data.detach().clone()

    for inner in opt.chained_optimizers if hasattr(opt, "chained_optimizers") else [opt]:
        for buffer in inner.buffers:
            for p in buffer.params:
                meta = sharded[id(p)]
                add("model", meta, p.data)
                state = _full(inner, p)
                for k, v in state.items():
                    add(k, meta, v)
    return out


def save(m, opt, path, metadata):
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    model_sd = m.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=metadata)}, path)
    dist.barrier()


def load(m, opt, path, metadata):  # as megamoe_trainer/checkpoint.py loads
    from megatron.core import dist_checkpointing

    m.load_state_dict(dist_checkpointing.load({"model": m.sharded_state_dict()}, path)["model"], strict=True)
    opt.reload_model_params()
    model_sd = m.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}, path
    )["optimizer"]
    with torch.no_grad():  # fp32 models: the master weights are views of the parameters
        opt.load_state_dict(loaded)


def across_kinds(rank, world, ckpt_dir, fmt, bucket_size=None, bf16=False):
    """For `fmt`: a stock run's checkpoint loads into a MegaMoE run, and a MegaMoE run's into a
    stock run, with every model parameter, fp32 master weight and Adam moment equal, bit for bit,
    per checkpoint key; one more step on the same batch then gives the same parameters (up to the
    two layer kinds' rounding). Returns the number of entries compared per direction."""
    init(rank, world)
    metadata = {"distrib_optim_sharding_type": fmt}
    counts = []
    for src_recipe, dst_recipe in ((None, "bf16"), ("bf16", None)):
        path = os.path.join(ckpt_dir, f"{fmt}-{src_recipe}")
        src, src_ddp, src_opt = trained(src_recipe, 11, bucket_size, bf16)
        if bucket_size is not None:  # the translation maps between buckets that differ in number and bounds
            assert all(len(b.buckets) > 1 for b in src_ddp.expert_parallel_buffers)
        save(src, src_opt, path, metadata)
        dst, dst_ddp, dst_opt = trained(dst_recipe, 12, bucket_size, bf16)  # other weights and moments
        before = by_checkpoint_key(dst, dst_opt)
        load(dst, dst_opt, path, metadata)
        want, got = by_checkpoint_key(src, src_opt), by_checkpoint_key(dst, dst_opt)
        assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
        bad = sorted(
            {(name, key) for name, key, off in want if not torch.equal(got[name, key, off], want[name, key, off])}
        )
        assert not bad, f"{len(bad)} entries differ after the load, e.g. {bad[:4]}"
        assert any(
            not torch.equal(before[k], want[k]) for k in want if k[1].startswith("decoder") and "experts" in k[1]
        )
        step(src_ddp, src_opt, 13), step(dst_ddp, dst_opt, 13)
        after_src, after_dst = by_checkpoint_key(src, src_opt), by_checkpoint_key(dst, dst_opt)
        # Adam's normalized step amplifies the two kinds' fp32 rounding where a gradient is
        # nearly zero (the layer norms' biases, zero at init): all parameters together, and
        # the routed experts' tensor by tensor
        names = [k for k in after_src if k[0] == "model"]
        together = rel_err(
            torch.cat([after_dst[k].flatten() for k in names]), torch.cat([after_src[k].flatten() for k in names])
        )
        experts = max(rel_err(after_dst[k], after_src[k]) for k in names if ".mlp.experts." in k[1])
        tol = (3e-2, 3e-2) if bf16 else (1e-4, 1e-5)  # bf16: the two kinds' bf16 rounding
        assert together < tol[0] and experts < tol[1], (together, experts)
        counts.append(len(want))
    return counts


def refused(rank, world, ckpt_dir, fmt):
    """For a format a MegaMoE optimizer does not support: a MegaMoE model cannot save it, nor
    load it (here a stock model's, where megatron-core can write one); both raise
    DistOptCheckpointError naming the format and the supported ones. Returns the messages."""
    init(rank, world)
    from megatron_patch import DistOptCheckpointError

    metadata = {"distrib_optim_sharding_type": fmt}
    mega, _, mega_opt = trained("bf16", 11, None)
    messages = []
    try:
        mega_opt.sharded_state_dict(mega.sharded_state_dict(), metadata=metadata)
    except DistOptCheckpointError as e:
        messages.append(str(e))
    path = os.path.join(ckpt_dir, f"{fmt}-stock")
    stock, _, stock_opt = trained(None, 11, None)
    try:
        save(stock, stock_opt, path, metadata)
    except Exception as e:  # megatron-core itself cannot write this format
        messages.append(f"stock save: {type(e).__name__}: {e}")
    else:
        try:
            load(mega, mega_opt, path, metadata)
        except DistOptCheckpointError as e:
            messages.append(str(e))
        assert len(messages) == 2, messages
    for text in (messages[0], messages[-1]) if len(messages) == 2 and "stock save" not in messages[1] else messages[:1]:
        assert fmt in text and "dp_reshardable" in text and "fully_reshardable" in text, text
    return messages
