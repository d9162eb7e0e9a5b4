"""mega_moe replayed from CUDA graphs: one captured forward and one captured backward per layer
(and a second pair for written-over main_grads, below).

Why: an eager mega_moe call issues ~100 kernels and torch ops from Python (publish, status
exchange, the plan's sorts and scatters, Triton launches, the GEMMs). At the training proxy's
shape that is ~5 ms of host time per forward against ~1.5 ms of GPU time, so a training step's
forward waits on the host. A replayed graph costs the host a few tens of microseconds.

What makes it possible: the GPU executor never reads the device on the host (no host sync,
shapes independent of the routing), its barriers count on the device, and a captured call
checks the ranks' status words on the device (protocol.py, "CUDA graphs" in docs/protocol.md).

What is captured, per layer: the whole call, forward and backward. Inputs are copied into
static tensors before a replay, the output is copied out; parameter gradients are the graph's
static tensors. Recipes that quantize the expert weights (fp8, mxfp8_mxfp4) get a third graph, the
weight preparation, into a static copy that the forward and backward graphs read, with every
operand the executor derives from it (the MX recipe's folded copies): it is replayed
before a forward replay only when the weights changed since the last one (weights.weight_state:
an optimizer step, or clear_weight_cache() after writes through `.data`, the same rule as the
eager cache). With gradient accumulation the weights are quantized once per optimizer step, not
once per micro-batch (at the training proxy: 21 ms of quantization per 4-micro-batch step).

Contract (checked where it can be):
- every rank replays the graphed layers sharing a buffer in the same order (as for eager calls);
- one forward in flight per layer: its backward runs before the same layer's next forward
  (no pipeline-parallel interleaving, no activation recompute of this layer);
- a call whose inputs differ in shape, dtype or requires_grad from the captured ones, or that
  runs with autograd disabled, runs eagerly (a correct, slower call);
- bad expert ids in a replay trap the process (a captured call cannot raise; the device
  barrier records the rank and call first);
- parameter gradients: a parameter with Megatron's `main_grad` gets the static gradient tensor
  itself (Megatron's gradient hook folds it into main_grad right away); any other parameter
  gets it through autograd's accumulation, which copies it.
- fuse_wgrad_accumulation=True (mega_moe's gradient-accumulation fusion, for w1 and w2 with a
  `main_grad`): the captured backward adds the expert wgrads into main_grad itself, so main_grad
  must keep its storage (Megatron DDP's grad buffer does: it is zeroed in place); a replay whose
  main_grad moved runs eagerly. The warm-up calls before capture add into scratch accumulators,
  never into main_grad.
- a fused call whose weights are flagged `overwrite_main_grad` (main_grad.py: the step's first
  micro-batch, its grad buffer not zeroed) writes over main_grad instead of adding: a second
  forward/backward pair, captured the first time it is needed. The flag is read at the forward
  (one forward in flight per layer, above) and used up by the backward replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .autograd import mega_moe
from .backends import executor_choice, executor_named
from .main_grad import wants_overwrite
from .symm_buffer import SymmBuffer
from .weights import quantize_expert_weights, weight_state


def _signature(*tensors: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in tensors)


def _storage(tensors) -> tuple:
    return tuple(None if t is None else t.data_ptr() for t in tensors)


class GraphedMegaMoE:
    """A mega_moe call over fixed weights (Parameters whose storage does not move: `serves` says
    whether it still stands for a call's arguments) and one buffer, captured at its first call
    with gradients enabled and replayed afterwards.

    call(x, topk_idx, topk_weights, recv_stats=None) -> y, like mega_moe with the weights given
    here. Built per layer (layers sharing a buffer keep their own layer_id and graphs).
    """

    def __init__(
        self,
        buffer: SymmBuffer,
        w1,
        w2,
        *,
        shared_w1=None,
        shared_w2=None,
        backend: str = "auto",
        layer_id: int = 0,
        warmup_calls: int = 2,
        fuse_wgrad_accumulation: bool = False,
    ):
        if buffer.device.type != "cuda":
            raise ValueError("GraphedMegaMoE: CUDA graphs need a CUDA buffer")
        if fuse_wgrad_accumulation and not (hasattr(w1, "main_grad") and hasattr(w2, "main_grad")):
            raise ValueError("GraphedMegaMoE: fuse_wgrad_accumulation needs w1 and w2 with a main_grad")
        executor, reason = executor_choice(backend, buffer.config, buffer.device)
        if executor != "triton":  # the reference reads the device on the host: it cannot be captured
            raise ValueError(
                f"GraphedMegaMoE: CUDA graphs need the GPU executor; backend {backend!r} runs {executor!r} for this "
                f"buffer (recipe {buffer.config.recipe!r}{': the GPU executor cannot, ' + reason if reason else ''})"
            )
        self.executor = executor_named(executor)
        self.fuse = fuse_wgrad_accumulation
        self.buffer = buffer
        self.params = [p for p in (w1, w2, shared_w1, shared_w2) if p is not None]
        self.weights = (w1, w2, shared_w1, shared_w2)  # what eager calls read
        self._weight_storage = _storage(self.weights)  # what the captured leaves alias
        self.backend = backend
        self.layer_id = layer_id
        self.warmup_calls = warmup_calls
        self._captured_signature = None
        self.leaves = None
        self.pairs: dict[bool, _CapturedPair] = {}  # by overwrite_main_grad (False: add into main_grad)
        self.replays = 0
        self.weight_preparations = 0  # replays of the weight-preparation graph (quantized recipes)
        self._prepared = self._prepared_state = None

    def serves(
        self, buffer: SymmBuffer, w1, w2, shared_w1=None, shared_w2=None, fuse_wgrad_accumulation: bool = False
    ) -> bool:
        """Whether this stands for mega_moe over these arguments: the same buffer and fusion, the
        same weights in the same storage. Megatron DDP moves parameters into its buffers when it
        wraps the model, so a layer called before the wrap must build its graphed call anew."""
        weights = (w1, w2, shared_w1, shared_w2)
        return (
            buffer is self.buffer
            and bool(fuse_wgrad_accumulation) == self.fuse
            and all(a is b for a, b in zip(weights, self.weights))
            and _storage(weights) == self._weight_storage
        )

    # ------------------------------------------------------------------ capture

    def _call(self, x, topk_idx, topk_weights, recv_stats, weights=None, prepared=None):
        w1, w2, sw1, sw2 = weights or self.weights
        return mega_moe(
            x,
            topk_idx,
            topk_weights,
            w1,
            w2,
            self.buffer,
            shared_w1=sw1,
            shared_w2=sw2,
            recv_stats=recv_stats,
            backend=self.backend,
            layer_id=self.layer_id,
            fuse_wgrad_accumulation=self.fuse,
            prepared_weights=prepared,
        )

    @property
    def prepared_weights(self):
        """The ExpertWeights the captured graphs read (quantized recipes, once captured), else None."""
        return self._prepared

    def _quantizes_weights(self) -> bool:
        return self.buffer.config.precision.weight_format != "native"

    def _prepare(self):
        """The quantized weights and every operand the executor derives from them, frozen (read
        only from then on). Made here, they are remade by each replay of the weight-preparation
        graph; made by their first reader, they would be made inside the first pair captured and
        remade by its replays only, so after a weight update the other pair would read stale ones."""
        weights = quantize_expert_weights(self.leaves[0], self.leaves[1], self.buffer.config)
        self.executor.prepare_weights(self.buffer.config, weights)
        weights.freeze_operands()
        return weights

    def _main_grads(self) -> tuple:
        """Where the expert wgrads of a replay go (fused accumulation): the storages captured."""
        return tuple(w.main_grad.data_ptr() for w in self.weights[:2]) if self.fuse else ()

    def _grad_inputs(self):
        params = [w for w in self.leaves if w is not None]
        return [t for t in (self.x, self.topk_weights, *params) if t.requires_grad]

    def _capture(self, x, topk_idx, topk_weights, overwrite: bool):
        """Captures the forward/backward pair for this main_grad mode; the first capture also
        makes the static inputs, the leaves and the weight-preparation graph."""
        first = not self.pairs  # also after a first capture that raised: its statics are redone
        dev = x.device
        if first:
            # The graphs differentiate leaves that alias the parameters' storage, not the parameters:
            # a parameter's gradient-accumulation node can outlive iterations (Megatron's DDP keeps
            # it) on the stream it was made on, and autograd would join that stream into the capture.
            self.leaves = tuple(None if w is None else w.detach().requires_grad_(w.requires_grad) for w in self.weights)
            self.x = x.detach().clone().requires_grad_(x.requires_grad)
            self.topk_idx = topk_idx.detach().clone()
            self.topk_weights = topk_weights.detach().clone().requires_grad_(topk_weights.requires_grad)
            self.recv_counts = torch.zeros(self.buffer.num_local_experts, dtype=torch.int64, device=dev)
            self.grad_y = torch.empty_like(x, dtype=self.buffer.config.dtype)
            self.pool = torch.cuda.graph_pool_handle()
        else:
            with torch.no_grad():  # the static inputs are leaves that require grad
                self.x.copy_(x)
                self.topk_idx.copy_(topk_idx)
                self.topk_weights.copy_(topk_weights)
        inputs = self._grad_inputs()
        if self.fuse:  # the warm-up calls add into (or write) scratch accumulators, not main_grad
            for leaf, w in zip(self.leaves[:2], self.weights[:2]):
                leaf.main_grad = torch.zeros_like(w.main_grad)

        # Warm-up calls on a side stream (as torch.cuda.make_graphed_callables does): the Triton
        # kernels compile before capture. (The CUTLASS workspaces are cached per stream, so the
        # first capture makes the capture stream's, shared by every captured graph: safe while
        # replays run one after another, as they do on the training stream.)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_calls):
                self._flag_leaves(overwrite)
                prepared = self._prepare() if self._quantizes_weights() else None  # (not cached on the leaves)
                y = self._call(self.x, self.topk_idx, self.topk_weights, self.recv_counts, self.leaves, prepared)
                torch.autograd.grad(y, inputs, self.grad_y.normal_(), allow_unused=True)
            del y, prepared
        torch.cuda.current_stream(dev).wait_stream(side)
        if self.fuse:  # captured (not run): the replays add into (or write) the parameters' main_grad
            for leaf, w in zip(self.leaves[:2], self.weights[:2]):
                leaf.main_grad = w.main_grad

        if first:
            self.prep_graph = None
            if self._quantizes_weights():  # captured, not run: the first replay prepares them
                self.prep_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.prep_graph, pool=self.pool):
                    self._prepared = self._prepare()
        pair = _CapturedPair(torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph())
        with torch.cuda.graph(pair.fwd_graph, pool=self.pool):
            pair.y = self._call(self.x, self.topk_idx, self.topk_weights, self.recv_counts, self.leaves, self._prepared)
        self._flag_leaves(overwrite)  # read by the captured backward
        with torch.cuda.graph(pair.bwd_graph, pool=self.pool):
            pair.grads = torch.autograd.grad(pair.y, inputs, self.grad_y, allow_unused=True)
        self.pairs[overwrite] = pair
        if self.fuse and first:  # w1's and w2's placeholder gradients, shared by a second pair
            grads = dict(zip(map(id, inputs), pair.grads))
            for leaf in self.leaves[:2]:
                leaf.placeholder = grads.get(id(leaf))
        self.recv_counts.zero_()  # the warm-up calls counted rows
        if first:
            self._captured_signature = _signature(x, topk_idx, topk_weights)
            self._captured_main_grads = self._main_grads()

    def _flag_leaves(self, overwrite: bool) -> None:
        if self.fuse:
            for leaf in self.leaves[:2]:
                leaf.overwrite_main_grad = overwrite

    # ------------------------------------------------------------------ replay

    def __call__(self, x, topk_idx, topk_weights, recv_stats=None):
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in (x, topk_weights, *self.params)):
            return self._call(x, topk_idx, topk_weights, recv_stats)
        if self._captured_signature is not None and (
            _signature(x, topk_idx, topk_weights) != self._captured_signature
            or self._main_grads() != self._captured_main_grads
        ):
            return self._call(x, topk_idx, topk_weights, recv_stats)
        overwrite = self.fuse and wants_overwrite(*self.weights[:2])
        if overwrite not in self.pairs:
            self._capture(x, topk_idx, topk_weights, overwrite)
        if self.prep_graph is not None:
            state = weight_state(self.weights[0], self.weights[1], self.buffer.config)
            if state != self._prepared_state:
                self.prep_graph.replay()
                self._prepared_state = state
                self.weight_preparations += 1
        self.replays += 1
        y = _Replay.apply(self, self.pairs[overwrite], x, topk_weights, topk_idx, *self.params)
        if recv_stats is not None:
            # checked after the replay: peers are in the same collective call (an eager call's
            # check rides in its status exchange instead)
            if (
                recv_stats.dtype != torch.int64
                or recv_stats.shape != self.recv_counts.shape
                or recv_stats.device != self.recv_counts.device
            ):
                self.recv_counts.zero_()
                raise ValueError(
                    f"recv_stats: expected int64 {list(self.recv_counts.shape)} on {self.recv_counts.device}, "
                    f"got {recv_stats.dtype} {list(recv_stats.shape)} on {recv_stats.device}"
                )
            recv_stats += self.recv_counts
        self.recv_counts.zero_()
        return y


@dataclass
class _CapturedPair:
    """One captured forward and its backward, with their static output tensors."""

    fwd_graph: torch.cuda.CUDAGraph
    bwd_graph: torch.cuda.CUDAGraph
    y: torch.Tensor | None = None
    grads: tuple | None = None


class _Replay(torch.autograd.Function):
    """Forward replays the captured forward; backward the captured backward. The differentiable
    inputs are x, topk_weights and the parameters, in that order (as captured)."""

    @staticmethod
    def forward(ctx, graphed: GraphedMegaMoE, pair: _CapturedPair, x, topk_weights, topk_idx, *params):
        graphed.x.copy_(x)
        graphed.topk_weights.copy_(topk_weights)
        graphed.topk_idx.copy_(topk_idx)
        pair.fwd_graph.replay()
        ctx.graphed, ctx.pair = graphed, pair
        return pair.y.detach().clone()  # the static output is overwritten by the next replay

    @staticmethod
    def backward(ctx, grad_y):
        g: GraphedMegaMoE = ctx.graphed
        pair: _CapturedPair = ctx.pair
        g.grad_y.copy_(grad_y)
        pair.bwd_graph.replay()
        grads = iter(pair.grads)  # one per captured input that requires grad, in capture order

        def take(t):
            return next(grads) if t.requires_grad else None

        grad_x, grad_tw = (None if d is None else d.clone() for d in (take(g.x), take(g.topk_weights)))
        # Megatron's hook moves .grad into main_grad at once: hand over the static tensor (a fresh
        # alias, which autograd adopts without a copy). Otherwise autograd copies it. With fused
        # accumulation the replay already put w1's and w2's into main_grad: their grads are the
        # captured placeholders, flagged for the hook as mega_moe flags them, and an overwrite
        # request is used up.
        param_grads = [
            grad.detach() if grad is not None and hasattr(p, "main_grad") else grad
            for p, grad in ((p, take(p)) for p in g.params)
        ]
        if g.fuse:
            for p in g.params[:2]:
                p.grad_added_to_main_grad = True
                p.overwrite_main_grad = False
        return None, None, grad_x, grad_tw, None, *param_grads
