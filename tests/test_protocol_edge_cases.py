"""Edge cases of the protocol's bookkeeping and failure handling, on real CPU processes: call
counters past the int32 status words, a rank failing outside a protocol step (its weight
transform) or before its exchange (its publish), and prepared weights of another width or dtype.
Deferred verdicts (several due together among them): tests/test_deferred_verdicts.py."""

from __future__ import annotations

import pytest
import torch
from dense_moe import dense_moe
from test_mega_moe_dist import BASE, rel_err
from test_reliability import _rank_inputs, fail_rank_1_in

from megamoe_train import MegaMoEConfig, MegaMoEInputError, get_symm_buffer, mega_moe, transform_weights


def calls_past_int32_phase(rank, world):
    """The status word is int32; the phase 2 * call passes 2^31 at call 2^30."""
    cfg, prob, w1, w2 = _rank_inputs(rank, world)
    buf = get_symm_buffer(None, cfg, timeout_s=10)
    buf.call_state.call_count = 2**30 - 1  # as after ~1e9 calls of one long-lived buffer
    x = prob["x"][rank].clone().requires_grad_()
    y = mega_moe(x, prob["idx"][rank], prob["w"][rank], w1, w2, buf)
    y.backward(prob["gy"][rank])
    y2 = mega_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], w1, w2, buf)
    y_ref = dense_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], prob["w1"], prob["w2"], cfg)
    assert rel_err(y.detach(), y_ref) < 1e-5 and torch.equal(y.detach(), y2)
    buf.destroy()


def test_call_epochs_past_int32(rank_pools):
    rank_pools(2).run(calls_past_int32_phase)


def weight_transform_fails_on_one_rank(rank, world):
    """A rank whose weight transform raises (e.g. out of memory) never joins the call: its
    peers must stop at once, told by its failure mark, not after the timeout."""
    from megamoe_train import autograd

    fail_rank_1_in(rank, world, autograd, "transform_weights")


def test_weight_transform_failure_fails_peers_at_once(rank_pools):
    rank_pools(2).run(weight_transform_fails_on_one_rank)


def prepared_weights_of_another_shape(rank, world, what):
    """prepared_weights whose experts have another width than the buffer's config must be bad
    input (MegaMoEInputError on every rank, buffer usable), not run (the reference computes an
    MLP of the other width; the GPU kernels would read past the weights)."""
    cfg, prob, w1, w2 = _rank_inputs(rank, world)
    buf = get_symm_buffer(None, cfg, timeout_s=10)
    x, idx, tw = prob["x"][rank], prob["idx"][rank], prob["w"][rank]
    prepared = None
    if rank == 1:
        if what == "intermediate":
            other = MegaMoEConfig(**dict(BASE, intermediate=16))
            prepared = transform_weights(w1[:, :32].contiguous(), w2[:, :, :16].contiguous(), other)
        else:  # dtype
            prepared = transform_weights(w1, w2, MegaMoEConfig(**dict(BASE, dtype=torch.bfloat16)))
    with pytest.raises(MegaMoEInputError) as err:
        mega_moe(x, idx, tw, w1, w2, buf, prepared_weights=prepared)
    if rank == 1:
        assert "prepared_weights" in str(err.value), str(err.value)
    y = mega_moe(x, idx, tw, w1, w2, buf)  # the buffer serves the next call
    assert rel_err(y, dense_moe(x, idx, tw, prob["w1"], prob["w2"], cfg)) < 1e-5


@pytest.mark.parametrize("what", ["intermediate", "dtype"])
def test_prepared_weights_of_another_shape_are_bad_input(rank_pools, what):
    rank_pools(2).run(prepared_weights_of_another_shape, what)


def publish_fails_on_one_rank(rank, world):
    """A rank failing before its exchange (in the publish) is named with the call it was in."""
    from megamoe_train.backends.reference import ReferenceExecutor

    cfg, prob, w1, w2 = _rank_inputs(rank, world)
    buf = get_symm_buffer(None, cfg, timeout_s=10)
    mega_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], w1, w2, buf)  # a good call first
    n = buf.call_state.call_count + 1
    original = ReferenceExecutor.store_inputs

    def broken(self, *args):
        raise MemoryError("injected failure in the publish")

    if rank == 1:
        ReferenceExecutor.store_inputs = broken
    try:
        with pytest.raises((MemoryError, RuntimeError)) as err:
            mega_moe(prob["x"][rank], prob["idx"][rank], prob["w"][rank], w1, w2, buf)  # call n
    finally:
        ReferenceExecutor.store_inputs = original
    if rank == 0:
        assert f"rank 1 failed in call {n} and left the protocol (rank 0 was waiting at barrier 1 of call {n})" in str(
            err.value
        ), str(err.value)


def test_rank_failing_in_its_publish_is_named_with_its_call(rank_pools):
    rank_pools(2).run(publish_fails_on_one_rank)
