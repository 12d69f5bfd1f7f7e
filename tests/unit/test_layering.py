"""Dependencies flow one way: every import of every module in megaformer/ points down the layering
written in megaformer/__init__.py (read from the source with ``ast``, imports inside functions
included)."""

from __future__ import annotations

import ast
from pathlib import Path

import megaformer

PACKAGE = Path(megaformer.__file__).parent

# Lower rank = lower layer. A unit is a subpackage (kernels, model, ...) or a top-level module.
RANK = {
    # the base: no megaformer imports beyond each other
    "megaformer": 0, "errors": 0, "config": 0, "accelerators": 0, "comm": 0, "deepspeed_attrs": 0,
    "safe_files": 0,
    "kernels": 1,
    "model": 2,
    "parallel": 3, "runtime": 3,
    "data": 4,
    "checkpoint": 5,
    "generation": 6,
    "diagnostics": 7,
    "analysis": 8, "evaluation": 8,
    "training": 9,
    "cli": 10, "__main__": 11,
}
# Units of equal rank that must not import each other.
PEERS_APART = {("parallel", "runtime"), ("runtime", "parallel"), ("analysis", "evaluation"),
               ("evaluation", "analysis")}
# (importing module, imported module) -> why an upward import is there for now. Keep it empty.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megaformer"


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported megaformer module, line) for every import statement, at any depth."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
    return [(n, line) for n, line in found if n == "megaformer" or n.startswith("megaformer.")]


def test_every_unit_has_a_rank():
    units = {_unit(m) for m, _ in _modules()}
    assert units - set(RANK) == set(), "rank the new package/module in RANK and in megaformer/__init__.py"


def test_imports_point_down():
    wrong = []
    for module, path in _modules():
        src = _unit(module)
        for target, line in _imports(module, path):
            dst = _unit(target)
            if dst == src or (module, target) in EXCEPTIONS:
                continue
            if RANK[dst] > RANK[src] or (src, dst) in PEERS_APART or \
                    (RANK[dst] == RANK[src] and RANK[src] > 0):
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
