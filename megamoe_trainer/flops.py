"""Model FLOPs per token and MFU of a recipe (the formula is documented in docs/trainer.md).

Counted per token, forward, as 2 FLOPs per multiply-add of every matrix product:
- attention, per layer: QKV projection 2*H*(n_h + 2*n_g)*d, output projection 2*n_h*d*H, and the
  causal score and value products 2 * 2*n_h*d*S/2 (each token attends to S/2 keys on average);
- dense MLP layers (SwiGLU): 2*H*2F + 2*F*H = 6*H*F;
- MoE layers: router 2*H*E, top-k routed experts k*6*H*I, shared expert 6*H*I_shared;
- embedding lookup 0, output layer 2*H*V.
Training = 3x forward (backward = 2x: input and weight gradients); activation recompute is not
counted (MFU counts model FLOPs, not hardware FLOPs). Norms, rotary, softmax, SwiGLU and losses
are elementwise and left out.
MFU = tokens/s (global) * training FLOPs per token / (world size * peak FLOP/s per GPU), shown
only where a peak is known: the recipe's run.peak_tflops, else the device's entry in
PEAK_TFLOPS_BY_GPU (none for CPUs).
"""

from __future__ import annotations

# Dense bf16 GEMM rate measured on one H200 (bench_layer's floor rates, 2026-11-30).
H200_BF16_PEAK_TFLOPS = 787.0
# per-GPU peak the MFU is relative to, by torch.cuda.get_device_name() prefix (measured rates only)
PEAK_TFLOPS_BY_GPU = {"NVIDIA H200": H200_BF16_PEAK_TFLOPS}


def peak_tflops(recipe, device_name: str | None) -> float | None:
    """The per-GPU peak MFU is relative to: run.peak_tflops, else the table's entry for the GPU
    (`device_name`; None on CPU), else None (no MFU)."""
    if recipe.run.peak_tflops is not None:
        return recipe.run.peak_tflops
    if device_name is None:
        return None
    return next((tf for prefix, tf in PEAK_TFLOPS_BY_GPU.items() if device_name.startswith(prefix)), None)


def _moe_layers(model) -> list[bool]:
    freq, n = model.moe_layer_freq, model.num_layers
    if isinstance(freq, list):
        return [bool(v) for v in freq]
    return [i % freq == 0 for i in range(n)]


def forward_flops_per_token(recipe) -> float:
    m, moe = recipe.model, recipe.moe
    H, S, V = m.hidden_size, m.seq_length, m.vocab_size
    n_h = m.num_attention_heads
    n_g = m.num_query_groups or n_h
    d = m.kv_channels or H // n_h
    attention = 2 * H * (n_h + 2 * n_g) * d + 2 * n_h * d * H + 2 * 2 * n_h * d * (S / 2)
    dense_mlp = 6 * H * m.ffn_hidden_size
    moe_mlp = 2 * H * moe.num_experts + moe.topk * 6 * H * moe.ffn_hidden_size
    if moe.shared_expert_ffn_hidden_size:
        moe_mlp += 6 * H * moe.shared_expert_ffn_hidden_size
    layers = sum(attention + (moe_mlp if is_moe else dense_mlp) for is_moe in _moe_layers(m))
    return layers + 2 * H * V


def train_flops_per_token(recipe) -> float:
    return 3 * forward_flops_per_token(recipe)


def mfu(recipe, tokens_per_s: float, peak_tflops: float) -> float:
    """Model FLOPs utilization in [0, 1] of `world_size` GPUs at `peak_tflops` each."""
    peak = peak_tflops * 1e12
    return tokens_per_s * train_flops_per_token(recipe) / (recipe.parallel.world_size * peak)
