"""engine never imports daemon: the trainer must run (and be tested) without the service."""

from __future__ import annotations

import ast
import json
import subprocess

from tests.helpers.processes import PY, REPO, child_env

ENGINE = REPO / "engine"


def daemon_imports(source: str) -> list[str]:
    """Every way a module could pull in `daemon`: import statements, importlib and __import__ with a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "daemon"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "daemon":
            found.append(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            arg = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(arg, str) and arg.split(".")[0] == "daemon":
                found.append(arg)
    return found


def test_the_scanner_sees_each_form_of_import():
    src = "import daemon\nfrom daemon.client.cli import main\nimport importlib\nimportlib.import_module('daemon.store.db')\n__import__('daemon')\n"
    assert daemon_imports(src) == ["daemon", "daemon.client.cli", "daemon.store.db", "daemon"]
    assert daemon_imports("import engine.daemonish\nfrom .daemon import x\n") == []


def test_no_engine_source_file_imports_daemon():
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 10
    offenders = {str(f.relative_to(REPO)): found for f in files if (found := daemon_imports(f.read_text()))}
    assert offenders == {}


def test_importing_every_engine_module_loads_no_daemon_module():
    code = (
        "import json, pkgutil, importlib, sys, engine\n"
        "names = [m.name for m in pkgutil.walk_packages(engine.__path__, 'engine.') if not m.name.endswith('__main__')]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(json.dumps({'imported': names, 'daemon': sorted(m for m in sys.modules if m.split('.')[0] == 'daemon')}))\n"
    )
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO, env=child_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "engine.run" in out["imported"]
    assert out["daemon"] == []
