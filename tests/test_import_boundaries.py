"""The client side stays light: treadle.types, treadle.sdk, treadle.recipes and treadle.sandbox never import
torch, peft or the worker, so a laptop needs only the SDK; the sandbox, a security boundary, imports nothing
else of treadle. And what the tests import is declared, not borrowed."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions

ROOT = pathlib.Path(__file__).resolve().parents[1] / "treadle"
LIGHT = [
    ROOT / "types",
    ROOT / "errors.py",
    ROOT / "settings.py",
    ROOT / "sdk",
    ROOT / "recipes",
    ROOT / "sandbox",
    ROOT / "queue",
]
FORBIDDEN = ("torch", "peft", "accelerate", "treadle.gpu_worker")


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_light_modules_never_import_heavy_ones():
    offenders = []
    for root in LIGHT:
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            for name in _imports(path):
                if name.split(".")[0] in ("torch", "peft", "accelerate") or name.startswith("treadle.gpu_worker"):
                    offenders.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    # The two lazy, opt-in exceptions: TensorData.to_torch, and forward_backward_custom, which runs the
    # user's torch loss on the client as Tinker's does. Neither is imported unless called.
    allowed = {"treadle/types/tensors.py imports torch", "treadle/sdk/training_client.py imports torch"}
    offenders = [o for o in offenders if o not in allowed]
    assert offenders == []


def test_sdk_and_recipes_import_without_torch():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {FORBIDDEN[:3]!r}: raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import treadle, treadle.types, treadle.sdk, treadle.recipes.math_rl, treadle.recipes.sft\n"
        "import treadle.recipes.code_rl, treadle.sandbox\n"
        "from treadle import ServiceClient, Datum, ModelInput, TensorData, SamplingParams, AdamParams\n"
        "assert not any(m.startswith('treadle.gpu_worker') for m in sys.modules)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def test_the_sandbox_imports_nothing_else_of_treadle():
    """The code sandbox is a security boundary: what it runs on is all in `treadle/sandbox/`, to be read alone."""
    outside = [
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for path in sorted((ROOT / "sandbox").rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] == "treadle" and not name.startswith("treadle.sandbox")
    ]
    assert outside == []


MAX_RECIPE_MAIN_LINES, MAX_RECIPE_FUNCTION_LINES = 80, 60


def test_recipes_read_top_to_bottom():
    """A recipe's `main` is at most 80 lines with no function inside it (a closure hides state); every other
    function of the recipes, their library and the sandbox is at most 60 lines."""
    too_long, nested = {}, []
    for path in sorted([*(ROOT / "recipes").rglob("*.py"), *(ROOT / "sandbox").rglob("*.py")]):
        name = str(path.relative_to(ROOT.parent))
        is_recipe = path.parent == ROOT / "recipes"
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            for fn in [n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                is_main = is_recipe and fn is node and fn.name == "main"
                lines = (fn.end_lineno or fn.lineno) - fn.lineno + 1
                if lines > (MAX_RECIPE_MAIN_LINES if is_main else MAX_RECIPE_FUNCTION_LINES):
                    too_long[f"{name}:{fn.name}"] = lines
                if is_main:
                    nested += [
                        f"{name}:main defines {n.name}"
                        for n in ast.walk(fn)
                        if n is not fn and isinstance(n, ast.FunctionDef)
                    ]
    assert too_long == {} and nested == []


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """treadle module -> the treadle modules it imports (at any depth, lazy imports included)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            # A module's own packages are imported before it anyway: importing one is no cycle.
            deps |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
        graph[name] = deps
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each import cycle as `a -> b -> a` (depth-first search; a back edge closes a cycle)."""
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_import_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]  # the check itself
    assert find_cycles(_import_graph()) == []


# The worker's layers, lowest first: a module imports only from its own layer and those below it, so the
# folder listing reads as the architecture (scheduling < model < training < sampling < engine < sessions < executor).
WORKER_LAYERS = [
    "scheduling",
    "model",
    "training",
    "sampling",
    "engine",
    "parallel",
    "sessions",
    "executor",
    "worker_main",
]
TOP_LEVEL_OF_ENGINE = {"engine", "model_profile", "model_check"}  # modules beside engine.py share its layer
TOP_LEVEL_OF_WORKER = {"worker_main", "worker_config", "wiring"}


def _worker_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["treadle", "gpu_worker"] or len(parts) < 3:
        return None
    top = (
        "engine" if parts[2] in TOP_LEVEL_OF_ENGINE else "worker_main" if parts[2] in TOP_LEVEL_OF_WORKER else parts[2]
    )
    return WORKER_LAYERS.index(top)


def test_worker_layers_import_one_way():
    assert sorted(p.name for p in (ROOT / "gpu_worker").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        set(WORKER_LAYERS) - {"engine", "worker_main"}
    )  # every sub-package has its place in the order
    upward = []
    for module, deps in _import_graph().items():
        layer = _worker_layer(module)
        if layer is None:
            continue
        upward += [
            f"{module} imports {dep}"
            for dep in sorted(deps)
            if (dep_layer := _worker_layer(dep)) is not None and dep_layer > layer
        ]
    assert upward == []


MAX_MODULE_LINES, MAX_FUNCTION_STATEMENTS = 400, 60


def test_modules_and_functions_stay_readable():
    """Split rather than squeeze: a module of at most 400 formatted lines, a function of at most 60 statements
    (statements, not lines: the formatter's wrapping of a long call is not what makes a function long)."""
    long_modules, long_functions = {}, {}
    for path in ROOT.rglob("*.py"):
        name = str(path.relative_to(ROOT.parent))
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            long_modules[name] = n
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                statements = {s.lineno for s in ast.walk(node) if isinstance(s, ast.stmt)}
                if len(statements) > MAX_FUNCTION_STATEMENTS:
                    long_functions[f"{name}:{node.name}"] = len(statements)
    assert long_modules == {}
    assert long_functions == {}


def _norm(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()  # PEP 503: PyYAML, pyyaml and py_yaml are one


def _declared_distributions() -> set[str]:
    """pyproject's dependencies and extras, and what scripts/setup.sh installs beside them (normalised names)."""
    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [d for extra in project.get("optional-dependencies", {}).values() for d in extra]
    specs += re.findall(r"([A-Za-z0-9][\w.-]*)==", (ROOT.parent / "scripts" / "setup.sh").read_text())
    return {_norm(re.split(r"[<>=!~\[; ]", spec)[0]) for spec in specs}


def test_every_third_party_module_the_tests_import_is_declared():
    """A test's import that arrives only as another package's dependency breaks when that package drops it."""
    modules = set()
    for path in (ROOT.parent / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    declared, owners = _declared_distributions(), packages_distributions()
    undeclared = {
        m: owners.get(m)
        for m in modules - set(sys.stdlib_module_names) - {"treadle", "tests"}
        if not any(_norm(d) in declared for d in owners.get(m, []))
    }
    assert undeclared == {}


def _names_an_op(node: ast.expr) -> bool:
    """An expression that holds an op's name: `x.op`, `op`, or a call's `name` (the device group's calls)."""
    return (isinstance(node, ast.Attribute) and node.attr == "op") or (
        isinstance(node, ast.Name) and node.id in ("op", "name")
    )


def test_op_names_are_compared_through_the_op_table():
    """`entry.op == StopRequest.op`, never `entry.op == "stop"`: the op table (`treadle/queue/ops.py`) is the one
    place an op's name is spelled, so renaming an op cannot leave a comparison behind."""
    from treadle.queue.ops import OPS

    spelled = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "queue" / "ops.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if not any(_names_an_op(o) for o in operands):
                    continue  # e.g. a stop_reason == "stop": a literal that happens to spell an op's name
                for operand in operands:
                    literals = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                    spelled += [
                        f"{path.relative_to(ROOT.parent)}:{node.lineno} {lit.value!r}"
                        for lit in literals
                        if isinstance(lit, ast.Constant) and lit.value in OPS
                    ]
    assert spelled == []


def test_every_redis_key_is_built_in_queue_names():
    """treadle/queue/names.py is the one place a Redis key is spelled: no other module holds a string that
    starts a key (`treadle:...`; `treadle://` paths are checkpoints, not keys)."""
    spelled = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "queue" / "names.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            texts = [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []
            if isinstance(node, ast.JoinedStr):  # an f-string's literal parts
                texts = [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            spelled += [
                f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                for text in texts
                if re.match(r"treadle:(?!//)\w", text)
            ]
    assert spelled == []


def test_routes_reach_treadle_only_through_the_backend():
    """The gateway's `Backend` is its one door: no gateway module reaches the ops client behind it."""
    reaching = [
        f"{path.relative_to(ROOT.parent)}:{node.lineno}"
        for path in (ROOT / "gateway").glob("*.py")
        if path.name != "backend.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in ("ops", "_ops")
        and isinstance(node.value, (ast.Name, ast.Attribute))
        and "backend" in ast.unparse(node.value)
    ]
    assert reaching == []
