"""The architecture as an import rule: engine/ subpackages in layers, no import cycles, no upward
imports, thin launched scripts."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Lowest first. A module may import from its own layer's package and from layers below it; sft, rm,
# ppo and dpo are peers that never import each other, and evaluate and export (after training) sit over
# them. engine/config.py and the engine/run_config/ package (the config schema) sit under everything;
# train/ sits on top. The models (loading, LoRA, DeepSpeed engines) sit under the
# run (process group, launch, lifecycle, checkpoints, guards) that drives them.
LAYERS = [
    ("engine.config", "engine.run_config"),
    ("engine.data",),
    ("engine.observe",),
    ("engine.models",),
    ("engine.run",),
    ("engine.rollout",),
    ("engine.rewards",),
    ("engine.environments",),
    ("engine.sft", "engine.rm", "engine.ppo", "engine.dpo"),
    ("engine.evaluate", "engine.export"),
    ("train",),
]


def module_name(path: Path, root: Path = REPO) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def is_module(name: str, root: Path = REPO) -> bool:
    """``name`` is a module or package in the tree under ``root``."""
    where = root.joinpath(*name.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def engine_imports(path: Path, root: Path = REPO) -> set[str]:
    """Every engine module ``path`` imports (at any depth of the file, type-checking imports included).

    ``from X import name`` imports the module ``X.name`` when there is one (``from engine.run import
    faults``), else ``X`` (``from engine.run.faults import poisoned``); relative imports count too."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per dot after the first
                anchor = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found |= {f"{base}.{a.name}" if is_module(f"{base}.{a.name}", root) else base for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {name for name in found if name == "engine" or name.startswith("engine.")}


def layer_of(module: str) -> int:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


CONFIG_PACKAGES = ("engine.run_config",)  # with the modules at engine/'s top, the config


def package_of(module: str) -> str:
    """engine.<subpackage>, "engine" for the config (the modules at engine/'s top and CONFIG_PACKAGES), "train"."""
    parts = module.split(".")
    if parts[0] == "train" or (REPO / "engine" / f"{parts[1]}.py").exists():
        return parts[0]
    return "engine" if ".".join(parts[:2]) in CONFIG_PACKAGES else ".".join(parts[:2])


def sources(root: Path = REPO) -> list[Path]:
    return sorted([*(root / "engine").rglob("*.py"), *(root / "train").glob("*.py")])


def import_cycle(root: Path = REPO) -> list[str] | None:
    """The first import cycle among the modules under ``root`` (``[a, b, ..., a]``), else None."""
    graph = {module_name(p, root): engine_imports(p, root) for p in sources(root)}
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, trail: list[str]) -> list[str] | None:
        if state.get(node) == 1:
            return trail[trail.index(node) :] + [node]
        if state.get(node) == 2 or node not in graph:
            return None
        state[node] = 1
        for nxt in sorted(graph[node]):
            if cycle := visit(nxt, trail + [node]):
                return cycle
        state[node] = 2
        return None

    return next((cycle for node in sorted(graph) if (cycle := visit(node, []))), None)


def test_every_import_goes_down_or_sideways_within_a_package():
    upward = []
    for path in sources():
        me = module_name(path)
        for target in engine_imports(path):
            if package_of(target) == package_of(me):
                continue
            if layer_of(target) >= layer_of(me) and not me.startswith("train"):
                upward.append(f"{me} -> {target}")
    assert not upward, "imports that do not go to a lower layer:\n" + "\n".join(upward)


def test_engine_modules_import_no_cycle():
    cycle = import_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_of_modules_from_a_package_are_followed(tmp_path):
    """``from engine.pkg import mod`` is an import of the module engine.pkg.mod, so a cycle through it is found;
    ``from engine.pkg.mod import name`` of engine.pkg.mod; ``from . import mod`` too."""
    files = {
        "engine/__init__.py": "",
        "engine/pkg/__init__.py": "",
        "engine/pkg/mod.py": "from engine.other import helper\n",
        "engine/pkg/sibling.py": "from . import mod\nfrom .mod import thing\n",
        "engine/other.py": "def helper():\n    from engine.pkg import mod, missing\n",
        "train/train_x.py": "from engine.pkg.mod import helper\nimport engine.other\nfrom engine import other\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    imports = lambda name: engine_imports(tmp_path / name, tmp_path)
    assert imports("engine/other.py") == {"engine.pkg.mod", "engine.pkg"}  # `missing` is no module: the package
    assert imports("engine/pkg/sibling.py") == {"engine.pkg.mod"}
    assert imports("train/train_x.py") == {"engine.pkg.mod", "engine.other"}
    assert import_cycle(tmp_path) == ["engine.other", "engine.pkg.mod", "engine.other"]
    (tmp_path / "engine/other.py").write_text("from engine.pkg.mod import helper\n")  # the other way round
    assert import_cycle(tmp_path) == ["engine.other", "engine.pkg.mod", "engine.other"]
    (tmp_path / "engine/pkg/mod.py").write_text("")
    assert import_cycle(tmp_path) is None


MAX_MAIN_STATEMENTS = 80  # train_ppo.py's main() today; a recipe grows by calling engine/ pieces, not by inlining them


def test_launched_scripts_are_recipes():
    """Each script's main() reads like its docstring: at most MAX_MAIN_STATEMENTS statements (counted
    in the syntax tree, so the formatter's line breaks do not count), no function defined inside it."""
    for path in sorted((REPO / "train").glob("train_*.py")):
        main = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
        statements = sum(isinstance(n, ast.stmt) for n in ast.walk(main)) - 1
        assert statements <= MAX_MAIN_STATEMENTS, f"{path.name}: main() has {statements} statements"
        nested = [
            n.name for n in ast.walk(main) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not main
        ]
        assert not nested, f"{path.name}: functions defined inside main(): {nested}"


TENSOR_COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "reduce", "gather", "scatter", "reduce_scatter"}


def test_tensor_collectives_go_through_the_distributed_module():
    """NCCL refuses a CPU tensor ("No backend type associated with device type cpu"), which gloo
    takes: a collective called on our CPU-side tensors anywhere but engine/run/distributed.py
    passes every CPU test and kills the first GPU run (a checkpoint timer did, at step 1)."""
    home = REPO / "engine" / "run" / "distributed.py"
    calls = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in sources()
        if path != home
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in TENSOR_COLLECTIVES
        and ast.unparse(node.func.value) in ("torch.distributed", "dist")
    ]
    assert not calls, f"tensor collectives outside {home.relative_to(REPO)} (use its all_reduce/agree_max): {calls}"
