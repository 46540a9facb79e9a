"""engine never imports daemon: the trainer must run (and be tested) without the service."""

from __future__ import annotations

import ast

from tests.helpers.processes import REPO

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


# --------------------------------------------------------------------- the recipe's command line is a script
def imports_of(source: str, module: str) -> list[str]:
    """Every way a source could import `module` (engine.run): import statements, `from engine import run`, and
    importlib.import_module / __import__ / a forkserver preload naming it. Running it as a program
    (`python -m engine.run`, runpy.run_module) is not importing it."""
    parent, _, leaf = module.rpartition(".")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == module or a.name.startswith(module + ".")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if node.module == module or (node.module or "").startswith(module + "."):
                found.append(node.module)
            elif node.module == parent and any(a.name == leaf for a in node.names):
                found.append(module)
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__", "set_forkserver_preload"):
                for arg in ast.walk(node):
                    if isinstance(arg, ast.Constant) and arg.value == module:
                        found.append(f"{name}('{module}')")
    return found


def test_the_recipe_scanner_sees_each_form_of_import():
    src = ("import engine.run\nimport engine.run as r\nfrom engine.run import main\nfrom engine import run, recipe\n"
           "importlib.import_module('engine.run')\nctx.set_forkserver_preload(['engine.run', 'peft'])\n")
    assert imports_of(src, "engine.run") == ["engine.run", "engine.run", "engine.run", "engine.run",
                                             "import_module('engine.run')", "set_forkserver_preload('engine.run')"]
    ran = "import engine.runner\nfrom engine import recipe\nargv = [PY, '-m', 'engine.run']\nrunpy.run_module('engine.run')\n"
    assert imports_of(ran, "engine.run") == []


def test_nothing_imports_the_trainer_command_line():
    """engine/run.py is `python -m engine.run`, a script (as torchtune's recipes are): the training recipe is
    engine/recipe.py and its parts live in their packages."""
    files = sorted(p for d in ("engine", "daemon", "bench", "tests") for p in (REPO / d).rglob("*.py"))
    assert len(files) > 100
    offenders = {str(f.relative_to(REPO)): found for f in files
                 if f.name != "test_import_boundary.py" and (found := imports_of(f.read_text(), "engine.run"))}
    assert offenders == {}
