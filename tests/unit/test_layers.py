"""The package's import graph: imports run downhill only, with no cycle, and no module imports
another module's private names.

Layers, top to bottom: ``bench`` (the benchmarks) -> ``tools`` (the CLI) -> ``compaction`` ->
``connector`` (the vLLM adapter) -> ``tiers`` -> the base (``semantics``, ``config`` and
``config_values``, ``presence``: pure Python). A module may
import its own layer and those below it. Imports inside functions count too (they are the way a
module defers an expensive import, not a way around the layering).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvstrata

ROOT = Path(kvstrata.__file__).parent
LAYERS = {"bench": 5, "tools": 4, "compaction": 3, "connector": 2, "tiers": 1, "semantics": 0,
          "config": 0, "config_values": 0, "presence": 0, "remote_address": 0, "auth": 0, "fsmode": 0}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 and parts[0] == "kvstrata" else None


def _imports(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported kvstrata module, names imported from it) for every import of ``path``."""
    tree = ast.parse(path.read_text())
    out: list[tuple[str, list[str]]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("kvstrata")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("kvstrata"):
                out.append((base, [a.name for a in node.names]))
    return out


def test_imports_run_downhill_without_cycles() -> None:
    modules = _modules()
    uphill = []
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        mine = _layer(module)
        for target, names in _imports(module, path):
            # "from kvstrata.tiers import codec" imports the module kvstrata.tiers.codec.
            targets = [f"{target}.{n}" if f"{target}.{n}" in modules else target for n in names] or [target]
            for t in targets:
                theirs = _layer(t)
                if mine is not None and theirs is not None and theirs > mine:
                    uphill.append(f"{module} imports {t}")
                top_mine, top_theirs = module.split(".")[:2], t.split(".")[:2]
                if top_mine != top_theirs and len(top_theirs) == 2:
                    graph.setdefault(".".join(top_mine), set()).add(".".join(top_theirs))
    assert not uphill, "\n".join(uphill)
    # No cycle between the packages (Tarjan would be overkill for a handful of nodes).
    for start in graph:
        seen, stack = set(), [start]
        while stack:
            node = stack.pop()
            for nxt in graph.get(node, ()):
                assert nxt != start, f"import cycle through {start} and {node}"
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)


def test_no_module_imports_another_modules_private_names() -> None:
    private = []
    for module, path in _modules().items():
        for target, names in _imports(module, path):
            if target != module:
                private += [f"{module}: from {target} import {n}" for n in names
                            if n.startswith("_") and not n.startswith("__")]
    assert not private, "\n".join(private)
