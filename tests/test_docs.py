"""The docs stay true to the code: every file and method the architecture guide names exists, every local
link resolves, and every code block marked `<!-- runnable -->` runs as written against a local stack.

A runnable block is the fenced block right after a `<!-- runnable -->` line. A `bash` block runs
with `bash -euo pipefail`, a `python` block with this interpreter, each in a fresh directory, with
the environment a user of the block would have: `TREADLE_BROKER_URL` and `TREADLE_STORAGE_URL` of
the tests' stack (which serves the tiny model as `tiny`), `TINKER_BASE_URL` and `TINKER_API_KEY` of
a gateway in front of it, and the venv's `bin/` first on PATH (so `treadle` and `python` resolve).
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.fixtures.gateway import ALICE_KEY

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The pages whose blocks may be marked runnable, and whose local links must resolve.
PAGES = ["README.md", "CONTRIBUTING.md", "docs/architecture.md", "docs/benchmarks.md"]
MARK = "<!-- runnable -->"
# A block may need a few minutes on a loaded 2-core machine (a session, a few ops on the tiny model);
# this bounds a block that hangs, it is not a speed requirement.
BLOCK_TIMEOUT_S = 600
_REPO_PATH = re.compile(r"`((?:treadle|tests|benchmarks|scripts|docs|deploy|requirements)/[\w./-]+?)`")
_METHOD = re.compile(r"`([A-Z]\w*)\.(\w+)[`(]")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_BLOCK = re.compile(re.escape(MARK) + r"\s*\n```(\w+)\n(.*?)\n```", re.S)


def _text(page: str) -> str:
    return (ROOT / page).read_text()


def _runnable_blocks() -> list[tuple[str, int, str, str]]:
    """(page, line, language, code) of every block marked runnable."""
    blocks = []
    for page in PAGES:
        text = _text(page)
        for match in _BLOCK.finditer(text):
            blocks.append((page, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2)))
    return blocks


def _missing(paths: set[str]) -> set[str]:
    return {p for p in paths if not (ROOT / p).exists()}


def test_every_file_the_architecture_guide_names_exists():
    named = set(_REPO_PATH.findall(_text("docs/architecture.md")))
    assert len(named) > 40, sorted(named)  # the trace, the durability story and the checklists name files
    assert not _missing(named), f"docs/architecture.md names files that do not exist: {sorted(_missing(named))}"


def _class_members() -> dict[str, set[str]]:
    """Every class of the treadle package by name, with the names its body defines."""
    members: dict[str, set[str]] = {}
    for path in (ROOT / "treadle").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = members.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return members


def test_every_method_the_architecture_guide_names_exists():
    members = _class_members()
    named = set(_METHOD.findall(_text("docs/architecture.md")))
    assert len(named) > 15, sorted(named)
    missing = sorted(f"{cls}.{name}" for cls, name in named if name not in members.get(cls, ()))
    assert not missing, f"docs/architecture.md names methods the code does not have: {missing}"


def test_every_local_link_resolves():
    broken = {}
    for page in PAGES:
        base = (ROOT / page).parent
        targets = {os.path.relpath(base / t, ROOT) for t in _LINK.findall(_text(page)) if "://" not in t}
        if missing := _missing(targets):
            broken[page] = sorted(missing)
    assert not broken, f"links to files that do not exist: {broken}"


def test_readme_is_a_short_page_that_links_every_guide():
    readme = _text("README.md")
    for doc in ["architecture", "benchmarks", "models", "gateway", "operations", "security", "scaling", "runs"]:
        assert f"](docs/{doc}.md)" in readme, f"README.md does not link docs/{doc}.md"
    assert len(readme.splitlines()) <= 220


def test_no_page_names_a_commit():
    for page in PAGES:
        commit = re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", _text(page))
        assert commit is None, f"{page} names commit {commit.group()}: git keeps history, the docs do not"


def test_readme_keeps_its_two_commands_first_and_ci_runs_the_second():
    commands = re.findall(r"^bash (scripts/\S+)", _text("README.md"), re.M)
    assert commands[:2] == ["scripts/demo.sh", "scripts/test.sh"]
    assert "bash scripts/test.sh" in _text(".ci/run")


def test_readme_has_runnable_blocks():
    languages = {lang for page, _, lang, _ in _runnable_blocks() if page == "README.md"}
    assert languages == {"bash", "python"}


@pytest.mark.parametrize("block", _runnable_blocks(), ids=lambda b: f"{b[0]}:{b[1]}")
def test_runnable_block_runs_as_written(block, stack, gateway, tmp_path):
    page, line, language, code = block
    env = {
        **os.environ,
        "TREADLE_BROKER_URL": stack.broker_url,
        "TREADLE_STORAGE_URL": stack.storage_url,
        "TINKER_BASE_URL": gateway.url,
        "TINKER_API_KEY": ALICE_KEY,
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        # This checkout's treadle, also where the venv's is another checkout's editable install.
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    if language == "bash":
        command = ["bash", "-euo", "pipefail", "-c", code]
    elif language == "python":
        command = [sys.executable, "-c", code]
    else:
        pytest.fail(f"{page}:{line}: a runnable block must be bash or python, not {language}")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    if done.returncode != 0:
        pytest.fail(f"{page}:{line} exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
