"""The import graph of the four packages, read from the source (every import statement,
those inside functions too): no module reaches itself again. Layers are checked apart
(`../shared/tools/check_layers.py`); a cycle inside one layer is what this finds."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compilecore", "passes", "models", "runtime")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports: `from pkg import sub` counts as `sub`
    where that is a module, else as `pkg`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names} & modules.keys()
            out.update(subs or {base})
    return (out & modules.keys()) - {name}


def import_cycles() -> list[list[str]]:
    """Each set of modules that import one another (Tarjan's strongly connected
    components of more than one module)."""
    modules = _modules()
    edges = {m: _imports(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_through_others():
    assert import_cycles() == []


def test_the_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The control: two modules of a package that import each other (one of them inside
    a function, as a lazy import does) are found."""
    package = tmp_path / "passes"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from passes.b import f\n")
    (package / "b.py").write_text("def f():\n    from passes import a\n")
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "ROOT", tmp_path)
    monkeypatch.setattr(this, "PACKAGES", ("passes",))
    assert import_cycles() == [["passes.a", "passes.b"]]
