"""The model `megamoe-train` trains: megatron-core GPTModel whose MoE layers come from the MegaMoE
adapter spec, in DistributedDataParallel, with megatron-core's optimizer.

`transformer_config(recipe)` is also built by the recipe validator, before any rank starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import perf


def transformer_config(recipe, on_gpu: bool = False):
    """The run's MegaMoETransformerConfig (also built by the validator, before any rank starts);
    on_gpu: the ranks run on CUDA (kernel choices that only exist there)."""
    from megatron_patch import MegaMoETransformerConfig

    m, moe, p = recipe.model, recipe.moe, recipe.parallel
    bf16 = m.dtype == "bf16"
    return MegaMoETransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        qk_layernorm=m.qk_layernorm,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.normalization,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=False,  # init through Megatron's RNG tracker: experts differ per EP rank
        tensor_model_parallel_size=p.tensor_parallel,
        sequence_parallel=p.tensor_parallel > 1,  # each TP rank's sequence shard through the MoE layers
        expert_tensor_parallel_size=1,
        pipeline_model_parallel_size=p.pipeline_parallel,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_stages,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        expert_model_parallel_size=p.expert_parallel,
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_layer_freq=m.moe_layer_freq,
        moe_token_dispatcher_type="alltoall",
        moe_router_score_function=moe.router_score_function,
        moe_router_pre_softmax=moe.router_pre_softmax,
        moe_router_topk_scaling_factor=moe.router_topk_scaling_factor,
        moe_router_num_groups=moe.router_num_groups,
        moe_router_group_topk=moe.router_group_topk,
        moe_router_enable_expert_bias=moe.router_expert_bias,
        moe_router_bias_update_rate=moe.router_bias_update_rate,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff if moe.load_balancing != "none" else 0.0,
        moe_z_loss_coeff=moe.z_loss_coeff,
        moe_router_dtype="fp32",
        cross_entropy_loss_fusion=recipe.perf.fused_cross_entropy and on_gpu,
        # perf/dense_wgrad.py gives the layers the extension
        gradient_accumulation_fusion=recipe.perf.dense_wgrad_fusion,
        cross_entropy_fusion_impl="native",  # megatron's own (torch.compile'd); "te" needs Transformer Engine
        moe_megamoe_recipe=moe.megamoe_recipe,
        moe_megamoe_backend=moe.megamoe_backend,
        moe_megamoe_cuda_graph=moe.megamoe_cuda_graph,  # None: the adapter decides (cuda_graphs_enabled)
        moe_megamoe_fuse_wgrad_accumulation=moe.megamoe_fuse_wgrad_accumulation,
        moe_megamoe_max_tokens_per_rank=recipe.max_tokens_per_rank,
    )


def build_model(recipe, device: str):
    """GPTModel (MegaMoE spec) -> [Float16Module] -> DDP, and its Megatron optimizer."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    cfg = transformer_config(recipe, on_gpu=device == "cuda")
    perf.install(recipe.perf, device)  # before the layers are built: they look for the wgrad extension
    m, t = recipe.model, recipe.train
    vp = recipe.parallel.virtual_pipeline_stages
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=t.overlap_grad_reduce,
        use_distributed_optimizer=t.use_distributed_optimizer,
    )
    chunks = []
    for stage in range(vp or 1):  # one model chunk per virtual pipeline stage, as Megatron-LM builds them
        vp_stage = stage if vp else None
        gpt = GPTModel(
            cfg,
            layer_spec(recipe, cfg, vp_stage),
            vocab_size=m.vocab_size,
            max_sequence_length=m.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            position_embedding_type=m.position_embedding,
            rotary_base=m.rotary_base,
            share_embeddings_and_output_weights=False,
            vp_stage=vp_stage,
        )
        if device == "cuda":
            gpt.cuda(torch.cuda.current_device())
        # Replicated (non-expert) weights must start equal on every data-parallel rank; DDP does not
        # broadcast them, so copy them from the first rank of the data-parallel group.
        dp_group = parallel_state.get_data_parallel_group()
        src = dist.get_global_rank(dp_group, 0)
        with torch.no_grad():
            for p in gpt.parameters():
                if getattr(p, "allreduce", True):
                    dist.broadcast(p.data, src=src, group=dp_group)
        chunks.append(Float16Module(cfg, gpt) if cfg.bf16 else gpt)
    # The 1/DP of the data-parallel mean is in the loss the trainer differentiates (train.py), so
    # DDP must sum the gradients without scaling them first. DDP reads that from
    # calculate_per_token_loss; nothing else the trainer runs does (megatron's schedules do, unused;
    # the routers read it when built, so it is set after them). Otherwise DDP multiplies every gradient buffer
    # by 1/DP before the reduction: a pass over all fp32 main_grads, the expert ones too (their
    # reduction group has one rank under full EP). Under pipeline parallelism the schedule runs:
    # pipeline_schedule() sets it back after.
    cfg.calculate_per_token_loss = True
    chunks = [DistributedDataParallel(cfg, ddp_cfg, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    if recipe.parallel.pipeline_parallel > 1:
        pipeline_schedule(cfg, chunks)
    model = chunks[0] if len(chunks) == 1 else ModelChunks(chunks)
    if recipe.moe.megamoe_fuse_wgrad_accumulation and recipe.moe.megamoe_overwrite_main_grad:
        from megatron_patch.grad_buffers import overwrite_expert_main_grads

        for chunk in chunks:
            overwrite_expert_main_grads(chunk)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        clip_grad=t.clip_grad,
        bf16=cfg.bf16,
        fp16=False,
        use_distributed_optimizer=t.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_cfg, chunks)
    perf.tune_optimizer(recipe.perf, optimizer, t.adam_moments_dtype)
    return model, optimizer, cfg


def layer_spec(recipe, cfg, vp_stage=None):
    """The MegaMoE adapter's GPT block spec (Megatron's local spec, MoE layers swapped when
    moe.megamoe_recipe is set) of this pipeline stage's layers (vp_stage: the model chunk), with
    SDPA core attention unless perf.attention is 'megatron', and norms that run under sequence
    parallelism (megatron_patch.norms)."""
    from megatron_patch import get_megamoe_gpt_decoder_block_spec, sequence_parallel_norms

    spec = get_megamoe_gpt_decoder_block_spec(cfg, use_transformer_engine=False, vp_stage=vp_stage)
    return perf.core_attention(recipe.perf, sequence_parallel_norms(spec))


def pipeline_schedule(cfg, chunks):
    """The config Megatron's pipeline schedules read. The trainer's loss already holds the 1/DP
    of the data-parallel mean and the schedule divides by the micro-batch count; with
    calculate_per_token_loss off (DDP read it at construction) the schedule scales the MoE aux
    losses by grad_scale_func(1) / micro-batches, the same 1 / (accum x DP) as without pipelining."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    cfg.calculate_per_token_loss = False
    cfg.grad_scale_func = lambda loss: loss / dp
    no_sync = [c.no_sync for c in chunks]
    cfg.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
    if chunks[0].ddp_config.overlap_grad_reduce:
        grad_sync = [c.start_grad_sync for c in chunks]
        cfg.grad_sync_func = grad_sync[0] if len(chunks) == 1 else grad_sync


class ModelChunks(torch.nn.ModuleList):
    """A rank's model chunks under virtual pipeline stages, used where the trainer uses one model:
    modules / parameters / train(), the config, and checkpoints (one entry per chunk, `model0`,
    `model1`, ..., as Megatron-LM writes them)."""

    @property
    def config(self):
        return self[0].config

    def sharded_state_dict(self, *args, **kwargs):
        return {f"model{i}": chunk.sharded_state_dict(*args, **kwargs) for i, chunk in enumerate(self)}

    def load_state_dict(self, state_dict, strict: bool = True):
        for i, chunk in enumerate(self):
            chunk.load_state_dict(state_dict[f"model{i}"], strict=strict)

    def zero_grad_buffer(self):
        for chunk in self:
            chunk.zero_grad_buffer()


def count_params(model) -> tuple[int, int]:
    """(parameters, routed-expert parameters) of this rank. Megatron marks expert weights with
    allreduce=False only under expert parallelism, so the module path names them too (EP 1)."""
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if not getattr(p, "allreduce", True) or ".mlp.experts." in name:
            expert += p.numel()
    return total, expert
