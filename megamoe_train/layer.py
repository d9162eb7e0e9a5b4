"""MegaMoELayer: the nn.Module that owns one rank's experts and calls mega_moe."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .autograd import mega_moe
from .config import MegaMoEConfig
from .graphs import GraphedMegaMoE
from .symm_buffer import SymmBuffer, get_symm_buffer, register_layer

_PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # validation.py's weight dtypes


class MegaMoELayer(nn.Module):
    """Routed experts [rank*E_local, (rank+1)*E_local) of the expert-parallel `process_group`
    (plus shared experts), run through the fused path. Routing is the caller's: forward takes
    topk ids and weights, so any router (Megatron's TopKRouter included) stays in charge.

    Parameters: w1 [E_local, 2I, H] (gate rows, then up rows), w2 [E_local, H, I], and with
    shared experts shared_w1 [2W, H], shared_w2 [H, W]. `expert_recv_stats` (int64 [E_local])
    accumulates the rows every local expert received from all ranks until reset. With
    cuda_graph=True a CUDA layer captures its call at the first training forward and replays
    it afterwards (graphs.py: the contract, e.g. one forward in flight).
    """

    def __init__(
        self,
        config: MegaMoEConfig,
        process_group=None,
        *,
        device=None,
        params_dtype: torch.dtype | None = None,
        init_std: float = 0.02,
        backend: str = "auto",
        buffer: SymmBuffer | None = None,
        cuda_graph: bool = False,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("MegaMoELayer: torch.distributed must be initialized first")
        if params_dtype is not None and params_dtype not in _PARAMS_DTYPES:
            # mega_moe takes only these for the weights: say so here, not at the first forward
            raise ValueError(f"params_dtype: must be one of {_PARAMS_DTYPES}, got {params_dtype}")
        self.config = config
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.backend = backend
        self.ep_rank = dist.get_rank(self.process_group)
        self.ep_size = dist.get_world_size(self.process_group)
        self.num_local_experts = config.experts_per_rank(self.ep_size)
        if buffer is not None:
            self._check_buffer(buffer)
        self._buffer = buffer
        self.layer_id = register_layer(self.process_group)  # names its calls in the status words
        dtype = params_dtype or config.dtype
        E, H, I = self.num_local_experts, config.hidden, config.intermediate
        self.w1 = nn.Parameter(torch.empty(E, 2 * I, H, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(E, H, I, device=device, dtype=dtype))
        if config.num_shared_experts:
            W = config.shared_width
            self.shared_w1 = nn.Parameter(torch.empty(2 * W, H, device=device, dtype=dtype))
            self.shared_w2 = nn.Parameter(torch.empty(H, W, device=device, dtype=dtype))
        else:
            self.shared_w1 = self.shared_w2 = None
        self.cuda_graph = cuda_graph  # on CUDA: replay forward/backward from graphs (graphs.py)
        self._graphed: GraphedMegaMoE | None = None
        self.register_buffer("expert_recv_stats", torch.zeros(E, dtype=torch.int64, device=device), persistent=False)
        self.reset_parameters(init_std)

    def reset_parameters(self, init_std: float = 0.02):
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, init_std)
            # output projections get the usual depth-free scaled init
            self.w2.mul_(1 / math.sqrt(2))
            if self.shared_w2 is not None:
                self.shared_w2.mul_(1 / math.sqrt(2))

    def _check_buffer(self, buffer: SymmBuffer):
        if buffer.config != self.config:
            raise ValueError(f"buffer: its config {buffer.config} does not match the layer's {self.config}")
        if buffer.group is not self.process_group:
            raise ValueError("buffer: it was created for a different process group than the layer's")

    @property
    def buffer(self) -> SymmBuffer:
        if self._buffer is None or not self._buffer.alive:
            if self._buffer is not None:  # after a device barrier's trap no new buffer can work: say why
                self._buffer.raise_device_fault()
            self._buffer = get_symm_buffer(self.process_group, self.config, device=self.w1.device)
        return self._buffer

    @property
    def local_expert_ids(self) -> range:
        return range(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    def reset_expert_recv_stats(self) -> torch.Tensor:
        """Returns the counts so far and zeroes them."""
        stats = self.expert_recv_stats.clone()
        self.expert_recv_stats.zero_()
        return stats

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.cuda_graph and x.is_cuda:
            buffer = self.buffer
            if self._graphed is None or self._graphed.buffer is not buffer:
                self._graphed = GraphedMegaMoE(
                    buffer,
                    self.w1,
                    self.w2,
                    shared_w1=self.shared_w1,
                    shared_w2=self.shared_w2,
                    backend=self.backend,
                    layer_id=self.layer_id,
                )
            return self._graphed(x, topk_idx, topk_weights, self.expert_recv_stats)
        return mega_moe(
            x,
            topk_idx,
            topk_weights,
            self.w1,
            self.w2,
            self.buffer,
            shared_w1=self.shared_w1,
            shared_w2=self.shared_w2,
            recv_stats=self.expert_recv_stats,
            backend=self.backend,
            layer_id=self.layer_id,
        )

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"experts={c.num_experts} (local {self.num_local_experts}), hidden={c.hidden}, "
            f"intermediate={c.intermediate}, topk={c.topk}, recipe={c.recipe!r}, shared={c.num_shared_experts}"
        )
