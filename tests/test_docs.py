"""The documentation against the tree and the validators (issue 22).

- docs/layout.md names every package under engine/ and daemon/ and every top-level folder of tests/, and every
  module it names exists;
- every `.py` path and every relative link in README.md and docs/ exists;
- every fenced ```yaml block is checked by the validator it documents: a job file (a top-level `model:` key, or
  a `# job` first line) by engine.config's parser, a daemon config (only daemon-config keys at the top) by
  daemon.config's loader. A block that is neither must say so on its first line (`# partial`, or `# not lorad's`
  for another program's file); those are skipped by name, so pytest's summary counts them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers.processes import REPO

LAYOUT = REPO / "docs" / "layout.md"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SKIP_MARKERS = ("# partial", "# not lorad's")
PY_PATH = re.compile(r"(?<![\w/.-])((?:engine|daemon|tests|bench)/[\w/]*\.py)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# --- the layout page against the tree ---------------------------------------------------------------------------

def packages() -> list[str]:
    """Every package directory under engine/ and daemon/, and every top-level folder of tests/, as `dir/`."""
    out = [rel(init.parent) + "/" for top in ("engine", "daemon") for init in sorted((REPO / top).rglob("__init__.py"))
           if "__pycache__" not in init.parts]
    out += [rel(d) + "/" for d in sorted((REPO / "tests").iterdir()) if d.is_dir() and d.name != "__pycache__"]
    return out


def layout_modules() -> list[tuple[int, str]]:
    """The .py files the layout page names: a bare `name.py` in a bullet under a "### `pkg/`" heading is pkg's."""
    out, pkg = [], ""
    for n, line in enumerate(LAYOUT.read_text().splitlines(), 1):
        heading = re.match(r"###\s+`([\w/]+/)`", line)
        if heading:
            pkg = heading.group(1)
            continue
        for name in re.findall(r"`([\w/.]+\.py)`", line):
            out.append((n, name if "/" in name else pkg + name))
    return out


@pytest.mark.parametrize("package", packages())
def test_every_package_is_named_on_the_layout_page(package):
    assert f"`{package}`" in LAYOUT.read_text(), f"docs/layout.md does not name {package}: add a line for it"


def test_every_module_the_layout_page_names_exists():
    missing = [f"docs/layout.md:{n}: {path}" for n, path in layout_modules() if not (REPO / path).is_file()]
    assert not missing, "the layout page names modules that do not exist:\n" + "\n".join(missing)


# --- paths and links on every page ------------------------------------------------------------------------------

def test_every_python_path_in_the_docs_exists():
    missing = [f"{rel(page)}: {m}" for page in PAGES for m in sorted(set(PY_PATH.findall(page.read_text())))
               if not (REPO / m).is_file()]
    assert not missing, "pages name files that do not exist:\n" + "\n".join(missing)


def test_every_relative_link_in_the_docs_exists():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor on the same page
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{rel(page)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_few_screens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "make demo" in text and "make test" in text  # CI hooks grep for these literal strings


# --- yaml examples against the validators -----------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    text: str

    def __str__(self) -> str:
        return f"{rel(self.page)}:{self.line}"


def yaml_blocks() -> list[Block]:
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        start = None
        for n, line in enumerate(lines, 1):
            if start is None and re.match(r"\s*```\s*ya?ml\b", line):
                start = n
            elif start is not None and line.strip().startswith("```"):
                out.append(Block(page, start, "\n".join(lines[start:n - 1]) + "\n"))
                start = None
    return out


BLOCKS = yaml_blocks()


def daemon_keys() -> set[str]:
    from daemon.config.daemon import DaemonConfig

    return set(DaemonConfig.model_fields)


@pytest.mark.parametrize("block", BLOCKS, ids=[str(b) for b in BLOCKS])
def test_every_yaml_example_passes_its_validator(block, tmp_path):
    first = block.text.lstrip().splitlines()[0] if block.text.strip() else ""
    if first.startswith(SKIP_MARKERS):
        pytest.skip(f"{block}: marked {first!r}, not validated")
    doc = yaml.safe_load(block.text)
    assert isinstance(doc, dict), f"{block}: not a YAML mapping; mark a deliberate fragment '# partial'"
    if "model" in doc or first.startswith("# job"):
        from engine.config.job import parse_job

        # Schema only, as for the shipped examples: documented jobs may name models that live elsewhere.
        assert parse_job(doc, REPO, source=str(block), check_paths=False).name
    elif set(doc) <= daemon_keys():
        from daemon.config.daemon import load_config

        cfg = tmp_path / "daemon.yaml"
        cfg.write_text(block.text)
        load_config(cfg)
    else:
        pytest.fail(f"{block}: neither a job (no top-level model:) nor a daemon config (keys {sorted(set(doc) - daemon_keys())} "
                    "are not daemon keys); fix it, or mark a deliberate fragment '# partial' on its first line")


def test_the_docs_have_job_and_daemon_examples():
    # The parametrized check above must not pass by having nothing to check.
    assert len(BLOCKS) >= 3
