"""The package layering, read from the source (ast) of every module, imports inside functions
included: the core `megamoe_train` imports neither the Megatron adapter `megatron_patch` nor the
trainer `megamoe_trainer`; the adapter does not import the trainer; inside `megamoe_train` a
module imports nothing of a higher layer (core -> backends -> kernels -> base, below); and no
modules of the three import each other in a circle (a package's __init__ counts as the modules
it imports, and importing a package's submodule from outside it imports its __init__ too)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megamoe_train", "megatron_patch", "megamoe_trainer")

# The layers of megamoe_train, from the top. core takes the call and runs the protocol, picking an
# executor by name; backends are the executors (the contract, the two implementations, their
# registry); kernels are the Triton and CUTLASS code that an executor launches; base is what all
# of them share (config, recipes, quantization, the plan, the expert weights, the buffer). Every
# module of megamoe_train not named here is base.
CORE = {
    "megamoe_train",
    "megamoe_train.demo",
    "megamoe_train.layer",
    "megamoe_train.graphs",
    "megamoe_train.autograd",
    "megamoe_train.protocol",
}
KERNELS = {
    f"megamoe_train.backends.{m}" for m in ("triton_kernels", "triton_plan", "triton_weight_prep", "cutlass_gemm")
}
LAYERS = ("base", "kernels", "backends", "core")  # bottom up


def _modules() -> dict[str, str]:
    """module name -> file path, for every .py of the three packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _bound_names(path: str) -> set[str]:
    """Names a module binds at its top level (defined or imported)."""
    names = set()
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """Modules of the three packages that `name` imports (relative imports resolved; a name
    taken from a package is its submodule, else the package's __init__ if that binds it, else
    an extension module such as megamoe_train._C, which imports nothing of ours)."""
    is_pkg = path.endswith("__init__.py")
    base = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                mod = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module
            targets = []
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in modules:
                    targets.append(sub)
                elif mod in modules and (
                    not modules[mod].endswith("__init__.py") or a.name in _bound_names(modules[mod])
                ):
                    targets.append(mod)
        else:
            continue
        for t in targets:
            while t and t not in modules:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t.split(".")[0] in PACKAGES:
                found.add(t)
                # importing a.b.c from outside a.b runs a.b's __init__ first (and a's)
                parent = t.rpartition(".")[0]
                while parent and not (name == parent or name.startswith(parent + ".")):
                    found.add(parent)
                    parent = parent.rpartition(".")[0]
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_core_imports_neither_adapter_nor_trainer():
    bad = {
        m: sorted(i for i in deps if i.split(".")[0] != "megamoe_train")
        for m, deps in _graph().items()
        if m.split(".")[0] == "megamoe_train"
    }
    assert not {m: d for m, d in bad.items() if d}


def test_adapter_does_not_import_trainer():
    bad = {
        m: sorted(i for i in deps if i.split(".")[0] == "megamoe_trainer")
        for m, deps in _graph().items()
        if m.split(".")[0] == "megatron_patch"
    }
    assert not {m: d for m, d in bad.items() if d}


def _layer(module: str) -> str:
    if module in CORE:
        return "core"
    if module.startswith("megamoe_train.backends"):
        return "kernels" if module in KERNELS else "backends"
    return "base"


def test_core_layers_import_only_downwards():
    """core -> backends -> kernels -> base: e.g. no base module (weights.py, say) imports an
    executor or a kernel; what it needs of one, the backend supplies (weights.supply_weight_kernels)."""
    modules = _modules()
    assert CORE | KERNELS <= set(modules), "a layer names a module that is gone"
    up = {}
    for m, deps in _graph().items():
        if m.split(".")[0] == "megamoe_train":
            above = sorted(d for d in deps if LAYERS.index(_layer(d)) > LAYERS.index(_layer(m)))
            if above:
                up[f"{m} ({_layer(m)})"] = [f"{d} ({_layer(d)})" for d in above]
    assert not up


def test_no_import_circles():
    graph = _graph()
    packages = {m for m, p in _modules().items() if p.endswith("__init__.py")}

    def through_faces(deps: set[str], seen=()) -> set[str]:
        """A package import stands for what its __init__ imports (its face)."""
        out = set()
        for d in deps:
            if d in packages and d not in seen:
                out |= through_faces(graph[d], (*seen, d))
            elif d not in packages:
                out.add(d)
        return out

    edges = {m: through_faces(d) - {m} for m, d in graph.items() if m not in packages}
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == "open":
                circles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not circles, " ; ".join(" -> ".join(c) for c in circles)


def test_the_rules_see_imports():
    """The parser finds what it should (guards the tests above against reading nothing)."""
    graph = _graph()
    assert "megamoe_trainer.recipe" in graph["megamoe_trainer.train"]
    assert "megamoe_trainer.model" in graph["megamoe_trainer.recipe"]  # inside a function
    assert "megamoe_train.launch" in graph["megamoe_trainer.cli"]  # inside a function
    assert "megatron_patch" in graph["megamoe_trainer.model"] or "megatron_patch.spec" in graph["megamoe_trainer.model"]
    assert "megamoe_train.backends.triton_backend" in graph["megamoe_train.backends"]  # inside a function
    assert "megamoe_train.weights" in graph["megamoe_train.backends.reference"]  # a relative import, two levels
    assert "megamoe_train" in graph["megamoe_trainer.report"]  # the package's __init__ runs first
    assert "megamoe_train.backends" in graph["megamoe_train.protocol"]  # likewise, inside the package
