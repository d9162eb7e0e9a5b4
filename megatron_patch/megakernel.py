"""Register MegaMoE as a `moe_megakernel_backend` of Megatron, where Megatron has that hook.

Megatron-LM main (after megatron-core 0.19) builds fused MoE backends through
`megatron.core.transformer.moe.megakernel.factory.build_megakernel_backend(*, config, ep_group,
routed_experts, shared_experts, num_local_experts)`, choosing on `config.moe_megakernel_backend`
(an if-chain: "mok" today, ValueError otherwise), and each backend is a `MegakernelBackend`
module with `forward(hidden_states, probs, routing_map) -> output`. There is no registry, so
`register_megakernel_backend()` wraps the three factory functions: for "megamoe" they build a
MegaMoE backend (routed + shared experts through mega_moe, weights owned by the native modules),
anything else goes to Megatron's original function.

megatron-core 0.19.2 has no such factory: then this is a no-op that returns False, and the
MegaMoE layer is switched on through the layer spec instead (megatron_patch.spec).
Not exercised against an upstream build here (none is installed); the spec path is the tested one.
"""

from __future__ import annotations

import contextlib
import importlib

BACKEND_NAME = "megamoe"
_registered = False


def register_megakernel_backend() -> bool:
    """Make `moe_megakernel_backend="megamoe"` build the MegaMoE backend. True if the installed
    Megatron has the megakernel factory (and it is now registered), False otherwise."""
    global _registered
    if _registered:
        return True
    try:
        factory = importlib.import_module("megatron.core.transformer.moe.megakernel.factory")
        base = importlib.import_module("megatron.core.transformer.moe.megakernel.backend").MegakernelBackend
    except (ImportError, AttributeError):
        return False

    from .moe_layer import MegaMoECall, routing_to_topk

    class MegaMoEMegakernel(base):
        """MegakernelBackend running routed + shared experts through mega_moe."""

        def __init__(self, *, config, ep_group, routed_experts, shared_experts, num_local_experts):
            super().__init__()
            if getattr(config, "moe_megamoe_recipe", None) is None:
                config.moe_megamoe_recipe = "bf16"
            for name, default in (("moe_megamoe_backend", "auto"), ("moe_megamoe_max_tokens_per_rank", None)):
                if not hasattr(config, name):
                    setattr(config, name, default)
            # the native modules stay the parameter owners (not registered again here)
            tp_group = getattr(shared_experts, "tp_group", None)  # Megatron's MLP splits the shared experts over it
            self._call = MegaMoECall(
                config, ep_group, routed_experts, shared_experts, num_local_experts, tp_group=tp_group
            )
            self.topk = config.moe_router_topk

        def forward(self, hidden_states, probs, routing_map):
            shape = hidden_states.shape
            topk_idx, topk_weights = routing_to_topk(probs, routing_map, self.topk)
            y = self._call(hidden_states.reshape(-1, shape[-1]), topk_idx, topk_weights)
            return y.view(shape)

    orig_build = factory.build_megakernel_backend
    orig_prepare = getattr(factory, "prepare_megakernel_shared_expert_config", None)
    orig_context = getattr(factory, "megakernel_shared_expert_init_context", None)

    def build_megakernel_backend(*, config, **kwargs):
        if getattr(config, "moe_megakernel_backend", None) == BACKEND_NAME:
            return MegaMoEMegakernel(config=config, **kwargs)
        return orig_build(config=config, **kwargs)

    def prepare_megakernel_shared_expert_config(config):
        if getattr(config, "moe_megakernel_backend", None) == BACKEND_NAME:
            return config
        return orig_prepare(config)

    def megakernel_shared_expert_init_context(config):
        if getattr(config, "moe_megakernel_backend", None) == BACKEND_NAME:
            return contextlib.nullcontext()
        return orig_context(config)

    patches = {"build_megakernel_backend": build_megakernel_backend}
    if orig_prepare is not None:
        patches["prepare_megakernel_shared_expert_config"] = prepare_megakernel_shared_expert_config
    if orig_context is not None:
        patches["megakernel_shared_expert_init_context"] = megakernel_shared_expert_init_context
    # the factory module, and modules that imported the functions by name
    for modname in ("megatron.core.transformer.moe.megakernel.factory", "megatron.core.transformer.moe.moe_layer"):
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for name, fn in patches.items():
            if hasattr(mod, name):
                setattr(mod, name, fn)
    _registered = True
    return True
