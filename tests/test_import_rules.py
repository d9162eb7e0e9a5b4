"""The package layering, read from the source (ast) of every module, imports inside functions
included: the core `megamoe_train` imports neither the Megatron adapter `megatron_patch` nor the
trainer `megamoe_trainer`; the adapter does not import the trainer; and no modules of the three
import each other in a circle (a package's __init__ counts as the modules it imports)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megamoe_train", "megatron_patch", "megamoe_trainer")


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
                elif mod in modules and (not modules[mod].endswith("__init__.py") or a.name in _bound_names(modules[mod])):
                    targets.append(mod)
        else:
            continue
        for t in targets:
            while t and t not in modules:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t.split(".")[0] in PACKAGES:
                found.add(t)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_core_imports_neither_adapter_nor_trainer():
    bad = {m: sorted(i for i in deps if i.split(".")[0] != "megamoe_train")
           for m, deps in _graph().items() if m.split(".")[0] == "megamoe_train"}
    assert not {m: d for m, d in bad.items() if d}


def test_adapter_does_not_import_trainer():
    bad = {m: sorted(i for i in deps if i.split(".")[0] == "megamoe_trainer")
           for m, deps in _graph().items() if m.split(".")[0] == "megatron_patch"}
    assert not {m: d for m, d in bad.items() if d}


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
                circles.append(stack[stack.index(d):] + [d])
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
