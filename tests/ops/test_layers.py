"""The house's rules, checked on the source: imports point down only, no package imports a
peer's or a higher one's modules, no circle inside a package, and the trainer's side never
imports pyspark.

Layers, lowest first (a module may import its own layer's package and the layers below):

0. ``pipelines.errors``: every error class and the exit codes; it imports nothing of the
   product's, so that ``schemas`` raises its ``SchemaError`` under ``UserwiseError`` too
1. ``schemas`` (every table's and file's schema), ``pipelines.console`` (a command's report)
   and ``pipelines.jagged`` (the jagged-array helpers the loader, trainer and serving share)
2. ``pipelines.runtime``: storage, progress, the Spark session, jars, Delta I/O, shipping
3. ``pipelines.config``: the column roles
4. ``pipelines.records``: the build folder's records (``_userwise/``)
5. ``pipelines.builder`` (step 1) and ``pipelines.shards`` (step 2): peers, neither imports the other
6. ``pipelines.loader`` (step 3)
7. ``pipelines.train``: the trainer's side
8. ``pipelines.manage``: backfill and forget, over both steps
9. ``pipelines.tools``: synthetic logs and samples, local stores
10. ``pipelines.api``: the Spark side's commands as Python functions, and the commands' handlers
11. ``pipelines.cli`` and the demo (``tools.demo``), which run the commands

Inside the loader, its subpackages are ordered the same way (:data:`LOADER`): ``logs``, then
``io`` (the reads), ``planning`` (the plans: shard metadata from ``io``), ``assembly`` (batches
from ``io``'s columns), ``workers``; the modules at the loader's top (``dataset``, ``loader``,
``diagnose``) put them together.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS = [
    ["pipelines.errors"],
    ["schemas", "pipelines.console", "pipelines.jagged"],
    ["pipelines.runtime"],
    ["pipelines.config"],
    ["pipelines.records"],
    ["pipelines.builder", "pipelines.shards"],
    ["pipelines.loader"],
    ["pipelines.train"],
    ["pipelines.serve"],
    ["pipelines.manage"],
    ["pipelines.tools"],
    ["pipelines.api"],
    ["pipelines.cli", "pipelines.tools.demo", "pipelines"],
]
# What a trainer imports without a JVM (schemas.core imports pyspark only inside to_spark()).
NEVER_PYSPARK = ("pipelines.loader", "pipelines.jagged", "pipelines.train", "pipelines.records", "pipelines.shards.stage",
                 "pipelines.shards.manifest", "pipelines.shards.gds", "pipelines.shards.balance",
                 "pipelines.shards.publish", "pipelines.config", "pipelines.errors",
                 "pipelines.serve")


# The loader's parts, lowest first: a loader module imports its own part and those before it.
LOADER = [
    ["pipelines.loader.logs"],
    ["pipelines.loader.io"],
    ["pipelines.loader.planning", "pipelines.loader.assembly", "pipelines.loader.workers"],
    ["pipelines.loader"],
]


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """Every module of the installed packages: dotted name (without ``userwise.``) -> file."""
    out = {}
    for top in ("pipelines", "schemas"):
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = p.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imports(path: Path) -> set[str]:
    """The userwise modules and packages a file imports (at any depth), without ``userwise.``;
    ``from pkg import mod`` counts as ``pkg.mod`` where that is a module."""
    mods = modules()
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s.removeprefix("userwise.") in mods] or [node.module]
        else:
            continue
        for n in names:
            if n.startswith("userwise."):
                n = n.removeprefix("userwise.")
                if n in mods:
                    out.add(n)
            elif n == "pyspark" or n.startswith("pyspark."):
                out.add("pyspark")
    return out


def layer_of(name: str) -> tuple[int, str]:
    """(layer index, the layer's package) of a module: the longest package prefix listed."""
    best = None
    for i, pkgs in enumerate(LAYERS):
        for pkg in pkgs:
            if name == pkg or name.startswith(pkg + "."):
                if best is None or len(pkg) > len(best[1]):
                    best = (i, pkg)
    if best is None:
        raise AssertionError(f"{name} is in no layer: add its package to LAYERS (and to CONTRIBUTING.md)")
    return best


def violations() -> list[str]:
    bad = []
    for name, path in modules().items():
        me, my_pkg = layer_of(name)
        for dep in imports(path):
            if dep == "pyspark":
                continue
            them, their_pkg = layer_of(dep)
            if them > me or (them == me and their_pkg != my_pkg and me != len(LAYERS) - 1):
                bad.append(f"{name} (layer {me}) imports {dep} (layer {them})")
    return sorted(bad)


def test_imports_point_down_only():
    assert violations() == []


def loader_violations() -> list[str]:
    """Loader modules that import a later part of the loader, or a peer part (:data:`LOADER`)."""
    def part(name):
        best = None
        for i, pkgs in enumerate(LOADER):
            for pkg in pkgs:
                if (name == pkg or name.startswith(pkg + ".")) and (best is None or len(pkg) > len(best[1])):
                    best = (i, pkg)
        return best

    bad = []
    for name, path in modules().items():
        if not name.startswith("pipelines.loader"):
            continue
        me, mine = part(name)
        for dep in imports(path):
            if dep.startswith("pipelines.loader") and dep != "pipelines.loader":
                them, theirs = part(dep)
                if them > me or (them == me and theirs != mine and me != len(LOADER) - 1):
                    bad.append(f"{name} ({mine}) imports {dep} ({theirs})")
    return sorted(bad)


def test_the_loader_s_parts_import_down_only(monkeypatch):
    assert loader_violations() == []
    import tests.ops.test_layers as me

    real = me.imports
    monkeypatch.setattr(me, "imports", lambda p: real(p) | ({"pipelines.loader.dataset"}
                                                           if p.name == "ring.py" else set()))
    assert "pipelines.loader.workers.ring (pipelines.loader.workers) imports pipelines.loader.dataset " \
           "(pipelines.loader)" in loader_violations()


def test_the_layer_check_can_fail(monkeypatch):
    import tests.ops.test_layers as me

    real = me.imports
    monkeypatch.setattr(me, "imports", lambda p: real(p) | ({"pipelines.builder.ingest"}
                                                           if p.name == "publish.py" else set()))
    assert "pipelines.shards.publish (layer 5) imports pipelines.builder.ingest (layer 5)" in violations()


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_circle_inside_a_package():
    mods = modules()
    graph = {n: {d for d in imports(p) if d != "pyspark" and d.rsplit(".", 1)[0] == n.rsplit(".", 1)[0]
                 and d != n and d in mods and not d.endswith("__init__")} for n, p in mods.items()}
    graph = {n: {d for d in deps if d != n.rsplit(".", 1)[0]} for n, deps in graph.items()}
    assert _cycle(graph) is None


def test_the_circle_check_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("pkg", NEVER_PYSPARK)
def test_the_trainer_side_never_imports_pyspark(pkg):
    hits = [n for n, p in modules().items() if (n == pkg or n.startswith(pkg + ".")) and "pyspark" in imports(p)]
    assert hits == []
