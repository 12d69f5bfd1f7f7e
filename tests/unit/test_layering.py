"""Dependencies flow one way: every import of every module in megaformer/ points down the layering
written in megaformer/__init__.py, and inside a package no two modules import each other, directly or
through others (read from the source with ``ast``, imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import megaformer

PACKAGE = Path(megaformer.__file__).parent

# Lower rank = lower layer. A unit is a subpackage (kernels, model, ...) or a top-level module.
RANK = {
    # the base: no megaformer imports beyond each other
    "megaformer": 0,
    "errors": 0,
    "config": 0,
    "accelerators": 0,
    "comm": 0,
    "deepspeed_attrs": 0,
    "safe_files": 0,
    "kernels": 1,
    "model": 2,
    "parallel": 3,
    "runtime": 3,
    # the one module of config that asks the device (kernel selection, FP8): a layer of its own
    "config.preflight": 3.5,
    "data": 4,
    "checkpoint": 5,
    "generation": 6,
    "diagnostics": 7,
    "analysis": 8,
    "evaluation": 8,
    "training": 9,
    "cli": 10,
    "__main__": 11,
}
# Units of equal rank that must not import each other.
PEERS_APART = {
    ("parallel", "runtime"),
    ("runtime", "parallel"),
    ("analysis", "evaluation"),
    ("evaluation", "analysis"),
}
# (importing module, imported module) -> why an upward import is there for now. Keep it empty.
EXCEPTIONS: dict[tuple[str, str], str] = {}
# Import cycles inside a package that are there for now (each a set of modules). Keep it empty.
CYCLES: list[frozenset[str]] = []


def _modules(package: Path = PACKAGE) -> list[tuple[str, Path]]:
    out = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    if parts[1:3] == ["config", "preflight"]:
        return "config.preflight"
    return parts[1] if len(parts) > 1 else "megaformer"


def _imports(module: str, path: Path, root: str = "megaformer") -> list[tuple[str, int]]:
    """(imported module of ``root``, line) for every import statement, at any depth; ``from P
    import m`` of a submodule ``m`` names ``P.m``."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
            found += [
                (f"{name}.{a.name}", node.lineno)
                for a in node.names
                if _is_submodule(path, module, name, a.name)
            ]
    return [(n, line) for n, line in found if n == root or n.startswith(root + ".")]


def _is_submodule(path: Path, module: str, package: str, name: str) -> bool:
    """Whether ``package.name`` is a module file or folder next to ``module``'s tree."""
    top = path.parents[len(module.split(".")) - (1 if path.name == "__init__.py" else 2)]
    where = top.parent.joinpath(*package.split("."), name)
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _cycles(package: Path = PACKAGE) -> list[frozenset[str]]:
    """The sets of modules of one unit (a subpackage or top-level module) that import each other,
    directly or round a longer loop (strongly connected components of the import graph)."""
    modules = dict(_modules(package))
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {_known(t, modules) for t, _ in _imports(module, path, package.name)}
        graph[module] = {
            t
            for t in targets
            if t and t != module and _unit(t) == _unit(module) and _unit(module) != package.name
        }
    return [c for c in _components(graph) if len(c) > 1]


def _known(name: str, modules: dict[str, Path]) -> str:
    """``name``, or its nearest enclosing module (``from m import function`` names ``m.function``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _components(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                out.append(frozenset(component))
    return out


def test_every_unit_has_a_rank():
    units = {_unit(m) for m, _ in _modules()}
    assert units - set(RANK) == set(), (
        "rank the new package/module in RANK and in megaformer/__init__.py"
    )


def test_imports_point_down():
    wrong = []
    for module, path in _modules():
        src = _unit(module)
        for target, line in _imports(module, path):
            dst = _unit(target)
            if dst == src or (module, target) in EXCEPTIONS:
                continue
            if (
                RANK[dst] > RANK[src]
                or (src, dst) in PEERS_APART
                or (RANK[dst] == RANK[src] and RANK[src] > 0)
            ):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {src} imports {target}")
    assert wrong == [], "upward imports:\n" + "\n".join(wrong)


def test_the_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "mod.py"
    f.write_text("import os\n\ndef f():\n    from megaformer.training import trainer\n")
    assert _imports("megaformer.model.mod", f) == [("megaformer.training", 4)]
    assert _unit("megaformer.training") == "training"
    assert RANK["training"] > RANK["model"]


def test_exceptions_are_still_needed():
    present = {(m, t) for m, p in _modules() for t, _ in _imports(m, p)}
    assert set(EXCEPTIONS) <= present, "remove the exceptions that no longer occur"


def test_the_package_docstring_names_every_unit():
    doc = megaformer.__doc__ or ""
    missing = [u for u in RANK if u not in ("megaformer", "__main__") and u not in doc]
    assert missing == []


def test_no_import_cycle_inside_a_package():
    found = _cycles()
    assert [sorted(c) for c in found if c not in CYCLES] == []
    assert [sorted(c) for c in CYCLES if c not in found] == [], "remove the cycles that are gone"


def test_the_cycle_check_sees_an_intra_package_cycle(tmp_path):
    root = tmp_path / "megaformer"
    (root / "store").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "store" / "__init__.py").write_text("")
    (root / "store" / "io.py").write_text("from megaformer.store import sharded\n")
    (root / "store" / "sharded.py").write_text("def f():\n    from megaformer.store.io import g\n")
    (root / "store" / "layout.py").write_text("from megaformer.store.io import g\n")
    assert _cycles(root) == [frozenset({"megaformer.store.io", "megaformer.store.sharded"})]
    (root / "store" / "sharded.py").write_text("def f():\n    return 1\n")
    assert _cycles(root) == []
