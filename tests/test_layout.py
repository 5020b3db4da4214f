"""The architecture as an import rule: engine/ subpackages in layers, no import cycles, no upward
imports, thin launched scripts."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Lowest first. A module may import from its own layer's package and from layers below it; sft, rm
# and ppo are peers that never import each other. engine/config.py and engine/run_config.py (the config
# schema) sit under everything; train/ sits on top.
LAYERS = [
    ("engine.config", "engine.run_config"),
    ("engine.data",),
    ("engine.observe",),
    ("engine.runtime",),
    ("engine.rollout",),
    ("engine.sft", "engine.rm", "engine.ppo"),
    ("train",),
]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def engine_imports(path: Path) -> set[str]:
    """Every engine module ``path`` imports (at any depth of the file, type-checking imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
            found |= {f"{node.module}.{a.name}" if node.module == "engine" else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("engine")}
    return found


def layer_of(module: str) -> int:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def package_of(module: str) -> str:
    """engine.<subpackage>, "engine" for the modules at engine/'s top (the config), "train"."""
    parts = module.split(".")
    return parts[0] if parts[0] == "train" or (REPO / "engine" / f"{parts[1]}.py").exists() else ".".join(parts[:2])


def sources() -> list[Path]:
    return sorted([*(REPO / "engine").rglob("*.py"), *(REPO / "train").glob("*.py")])


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
    graph = {module_name(p): {t for t in engine_imports(p)} for p in sources()}
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(node) :] + [node]))
        if state.get(node) == 2 or node not in graph:
            return
        state[node] = 1
        for nxt in sorted(graph[node]):
            visit(nxt, trail + [node])
        state[node] = 2

    for node in sorted(graph):
        visit(node, [])


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
