"""The import graph of engine/ and daemon/: no cycles (function-level imports count), engine never imports
daemon, and every module imports on its own, without another project module having been imported first."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
from pathlib import Path

from tests.helpers.processes import PY, REPO, child_env

PACKAGES = ("engine", "daemon")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its source (top level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            # importing a.b.c runs a, a.b and a.b.c; the leaf is the edge that matters for cycles
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {n: imports_of(n, p, set(mods)) for n, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_sees_a_cycle_through_three_modules():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    known = {"engine", "engine.x", "engine.y", "engine.z"}
    src = tmp_path / "x.py"
    src.write_text("from . import y\n\ndef f():\n    from engine.z import thing\n")
    assert imports_of("engine.x", src, known) == {"engine.y", "engine.z"}


def test_there_is_no_import_cycle_in_engine_or_daemon():
    graph = import_graph()
    assert len(graph) > 40
    assert cycles(graph) == []


def package_of(module: str) -> str:
    """The part a module belongs to: its first two name parts (engine.checkpoint, daemon.supervisor); a module at
    the top of engine/ or daemon/ (engine.run, daemon.protocol) is a part of its own."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        mine = package_of(m)
        out.setdefault(mine, set()).update(d for d in map(package_of, deps) if d != mine)
    return out


def test_packages_are_what_the_module_graph_says():
    g = {"engine.a.x": {"engine.b.y"}, "engine.b.y": {"engine.errors"}, "engine.errors": set()}
    assert package_graph(g) == {"engine.a": {"engine.b"}, "engine.b": {"engine.errors"}, "engine.errors": set()}
    assert cycles(package_graph({"engine.a.x": {"engine.b.y"}, "engine.b.z": {"engine.a.w"}})) == [
        ["engine.a", "engine.b"]]


def test_there_is_no_import_cycle_between_packages():
    """engine.checkpoint may import engine.storage, or the other way round, never both: each part can be read
    (and changed) knowing only the parts below it."""
    packages = package_graph(import_graph())
    assert {"engine.checkpoint", "engine.training", "daemon.supervisor", "daemon.service"} <= set(packages)
    assert cycles(packages) == []


def test_engine_never_imports_daemon_anywhere_in_its_graph():
    graph = import_graph()
    bad = {m: sorted(d for d in deps if d.split(".")[0] == "daemon") for m, deps in graph.items()
           if m.split(".")[0] == "engine"}
    assert {m: d for m, d in bad.items() if d} == {}


@functools.cache
def imported_alone() -> dict[str, dict]:
    """Each module imported in one child with no other engine/daemon module loaded before it (third-party ones may
    stay): {module: {"error": its traceback or None, "daemon": the daemon modules it loaded}}. One child for both
    tests below that read it: each module imports the whole training stack again (seconds)."""
    code = (
        "import importlib, json, sys, traceback\n"
        f"names = {sorted(n for n in project_modules() if not n.endswith('__main__'))!r}\n"
        "out = {}\n"
        "for n in names:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] in ('engine', 'daemon')]:\n"
        "        del sys.modules[m]\n"
        "    error = None\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except Exception:\n"
        "        error = traceback.format_exc(limit=3)[-600:]\n"
        "    out[n] = {'error': error, 'daemon': sorted(m for m in sys.modules if m.split('.')[0] == 'daemon')}\n"
        "print(json.dumps(out))\n"
    )
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO, env=child_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_every_module_imports_on_its_own():
    assert {n: r["error"] for n, r in imported_alone().items() if r["error"]} == {}


def test_importing_every_engine_module_loads_no_daemon_module():
    """engine never imports daemon, at run time too (tests/test_import_boundary.py reads the sources). Here, not
    there: the child that imports every module alone costs seconds, and pytest-xdist's loadfile would run it once
    per file."""
    engine = {n: r["daemon"] for n, r in imported_alone().items() if n.split(".")[0] == "engine"}
    assert "engine.run" in engine
    assert {n: loaded for n, loaded in engine.items() if loaded} == {}
