"""Both executors against the contract of backends/executor.py: every member it declares, with
the same parameters in the same order, and the contract declares exactly what protocol.py and
graphs.py (a graphed layer's weight preparation) ask of an executor (read from their source), so
neither can drift from the other."""

from __future__ import annotations

import ast
import inspect

import pytest

from megamoe_train import graphs, protocol
from megamoe_train.backends.executor import Executor
from megamoe_train.backends.reference import ReferenceExecutor


def _executor_class(name: str):
    if name == "reference":
        return ReferenceExecutor
    pytest.importorskip("triton", reason="the GPU executor needs triton to be imported")
    from megamoe_train.backends.triton_backend import TritonExecutor

    return TritonExecutor


def _contract() -> tuple[set[str], set[str]]:
    """(the methods, the attributes) that Executor declares."""
    methods = {n for n, v in vars(Executor).items() if inspect.isfunction(v) and not n.startswith("_")}
    return methods, set(Executor.__annotations__)


def _asked_by_protocol() -> set[str]:
    """Every `executor.NAME` that protocol.py reads, and every `self.executor.NAME` of graphs.py."""
    asked = set()
    for module in (protocol, graphs):
        path = inspect.getsourcefile(module)
        for n in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(n, ast.Attribute) and (
                (isinstance(n.value, ast.Name) and n.value.id == "executor")
                or (isinstance(n.value, ast.Attribute) and n.value.attr == "executor")
            ):
                asked.add(n.attr)
    return asked


def test_the_contract_is_what_the_protocol_asks():
    methods, attributes = _contract()
    asked = _asked_by_protocol()
    assert asked, "the protocol's executor calls were not found"
    # checks_ids_on_device is read by mega_moe (autograd.py), before the protocol runs
    assert asked | {"name", "checks_ids_on_device"} == methods | attributes


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_executor_keeps_the_contract(backend):
    cls = _executor_class(backend)
    methods, _ = _contract()
    executor = cls()
    assert isinstance(executor, Executor)  # every member is there
    assert executor.name == backend
    assert isinstance(executor.reads_device_on_host, bool) and isinstance(executor.checks_ids_on_device, bool)
    for name in sorted(methods):
        want = list(inspect.signature(getattr(Executor, name)).parameters.values())
        got = list(inspect.signature(getattr(cls, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in got] == [(p.name, p.kind, p.default) for p in want], (
            f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} differs from the contract's "
            f"{name}{inspect.signature(getattr(Executor, name))}"
        )


def test_executor_state_classes_have_distinct_names():
    """Each executor's pool and state types are its own, named for it."""

    def own_classes(cls) -> set[str]:
        module = inspect.getmodule(cls)
        return {n for n, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__}

    reference, triton = own_classes(_executor_class("reference")), own_classes(_executor_class("triton"))
    assert {"ReferencePoolInputs", "ReferenceExpertState"} <= reference
    assert {"TritonPoolInputs", "TritonExpertState", "TritonPoolGrad"} <= triton
    assert not reference & triton
