"""The fault record a CUDA device barrier writes before it traps, decoded on the host
(megamoe_train/faults.py): each kind names the rank, the peer and the call."""

from megamoe_train import faults as f


def record(**words):
    r = [0] * f.RECORD_WORDS
    for name, value in words.items():
        if name in ("my_word", "peer_word"):
            start = f.MY_WORD if name == "my_word" else f.PEER_WORD
            r[start : start + 3] = value
        else:
            r[getattr(f, name.upper())] = value
    return r


def test_no_fault():
    assert f.describe_fault([0] * f.RECORD_WORDS) is None


def test_timeout_names_the_missing_rank_and_barrier():
    text = f.describe_fault(record(kind=f.TIMED_OUT, rank=1, tag=7 * 4 + 2, peer=0, value=13, timeout_ms=2500))
    assert text.startswith("rank 1: rank 0 did not reach barrier 2 of call 7 within 2.5s"), text


def test_failed_peer_names_its_call():
    text = f.describe_fault(record(kind=f.PEER_FAILED, rank=0, tag=9 * 4 + 2, peer=1, value=9 * 4 + 1))
    want = "rank 1 failed in call 9 and left the protocol (device barrier, rank 0 at barrier 2 of call 9)"
    assert text.startswith(want), text
    assert "buffer creation" in f.describe_fault(record(kind=f.PEER_FAILED, rank=0, tag=0, peer=1, value=1))


def test_out_of_step():
    text = f.describe_fault(record(kind=f.OUT_OF_STEP, rank=0, tag=5 * 4 + 1, peer=1, value=6 * 4 + 1))
    assert text == "rank 0 at barrier 1 of call 5 met rank 1 at barrier 1 of call 6: the ranks are out of step"


def test_captured_call_mismatch_and_bad_input():
    words = dict(my_word=(5, 2, 11), peer_word=(5, 1, 10))
    text = f.describe_fault(record(kind=f.CALL_MISMATCH, rank=1, tag=21, peer=0, **words))
    assert "captured CUDA graph" in text and "different calls" in text
    assert "rank 1: backward of forward call 5 of layer 2 (call 5); rank 0: forward of layer 1 (call 5)" in text
    assert type(f.fault_error(record(kind=f.CALL_MISMATCH))).__name__ == "MegaMoECallMismatchError"
    text = f.describe_fault(record(kind=f.BAD_INPUT, rank=0, tag=21, peer=1, value=2, my_word=(5, 1, 10)))
    assert "rank 1 rejected its input" in text and "forward of layer 1 (call 5)" in text
    assert type(f.fault_error(record(kind=f.BAD_INPUT))).__name__ == "MegaMoEInputError"


def test_errors_of_records():
    assert f.fault_error([0] * f.RECORD_WORDS) is None
    err = f.fault_error(record(kind=f.TIMED_OUT, rank=0, tag=9, peer=1, timeout_ms=3000))
    assert type(err).__name__ == "MegaMoEPeerError"
    assert "rank 1 did not reach" in str(err) and "context is lost" in str(err)


def test_watcher_reports_a_new_record_once_on_stderr(capsys):
    import time

    import torch

    class Transport:  # what the watcher reads of a CUDA transport
        fault_record = torch.zeros(f.RECORD_WORDS, dtype=torch.int64)

    owner = Transport()
    f.watch(owner)
    time.sleep(3 * f.POLL_S)
    assert "MegaMoE device fault" not in capsys.readouterr().err
    words = record(kind=f.TIMED_OUT, rank=1, tag=7 * 4 + 1, peer=0, value=12, timeout_ms=3000)
    owner.fault_record[1:] = torch.tensor(words[1:])
    owner.fault_record[f.KIND] = f.TIMED_OUT  # the kind last, as the device writes it
    time.sleep(4 * f.POLL_S)
    err = capsys.readouterr().err
    assert err.count("MegaMoE device fault: rank 1: rank 0 did not reach barrier 1 of call 7 within 3s") == 1, err
    time.sleep(3 * f.POLL_S)
    assert "MegaMoE device fault" not in capsys.readouterr().err  # once
