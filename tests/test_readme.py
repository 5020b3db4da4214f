"""The README and the guides in docs/ work as written: every command of their shell blocks runs, in
order, from the repository root of a fresh copy, in the environment `make setup` made; every
config example dry-runs on the demo data those commands prepared, its values show in the plan,
and the same example with a misspelled key is refused.

The README's first block (`make setup`, `make demo`, `make test`) is CI itself (.ci/run runs setup
and test) and the demo. Its other blocks, if any, run first, then the pages of docs/ in
DOCS_ORDER (demo.md makes the demo's data and models, which later guides use); a guide's command
that repeats one already run is not run again; docs/own-model.md's commands run in a lane of their
own beside the others (the two take about as long), and every launch on a free port; a lane's
plain `python` commands share one interpreter (tests/scripts/python_commands.py), each run as
`python` would run it; the first one-rank launch (`deepspeed --num_gpus 1`) runs as written, the
others as `python` in a process of their own (the launcher adds ~7 s of start and exit and nothing
else for one rank). Training commands run shortened (`--train.max_steps 2`, `--train.iterations 1`
appended: the full runs are the demo and the end-to-end tests); the guides prefer `--dry-run`
where a full run adds nothing. Weights & Biases is off (WANDB_MODE=disabled: its service's start and
stop cost seconds a run; tests/test_train_rm.py checks an offline wandb run).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import free_port

from engine.config import ConfigError, load_config
from engine.run_config import SCRIPT_CONFIGS

REPO = Path(__file__).resolve().parent.parent
SHORTER = {
    "train/train_sft.py": "--train.max_steps 2",
    "train/train_rm.py": "--train.max_steps 2",
    "train/train_ppo.py": "--train.iterations 1",
    "train/train_dpo.py": "--train.max_steps 2",
}
# The order the shell blocks of docs/ run in, after the README's: the order of docs/README.md's index.
DOCS_ORDER = [
    "README.md",
    "install.md",
    "demo.md",
    "evaluation.md",
    "data.md",
    "own-model.md",
    "configs.md",
    "configuration.md",
    "sft.md",
    "reward-model.md",
    "ppo.md",
    "distillation.md",
    "dpo.md",
    "rewards.md",
    "sandbox.md",
    "multi-turn.md",
    "lora.md",
    "multi-node.md",
    "gpu.md",
    "crash-safety.md",
    "run-directory.md",
    "benchmarks.md",
    "design.md",
    "troubleshooting.md",
    "metrics.md",
    "development.md",
]
# Commands that share no file with the others, run in a second lane beside them: the own-model
# walk-through's (docs/own-model.md).
SECOND_LANE = ("runs/own/",)
ONE_RANK = "deepspeed --num_gpus 1 "
EXAMPLE_SCRIPTS = {
    "docs/sft.md": "train/train_sft.py",
    "docs/reward-model.md": "train/train_rm.py",
    "docs/dpo.md": "train/train_dpo.py",
}


def pages() -> list[Path]:
    """README.md, then the pages of docs/ in DOCS_ORDER."""
    return [REPO / "README.md", *(REPO / "docs" / name for name in DOCS_ORDER)]


def fenced_blocks(page: Path, language: str) -> list[str]:
    """The text of every ```language block of a Markdown page, in order."""
    blocks, fence, lines = [], None, []
    for line in page.read_text().splitlines():
        if fence is None and line.startswith("```"):
            fence, lines = line[3:].strip(), []
        elif fence is not None and line.strip() == "```":
            if fence == language:
                blocks.append("\n".join(lines) + "\n")
            fence = None
        elif fence is not None:
            lines.append(line)
    return blocks


def shell_commands(block: str) -> list[str]:
    """One command per line (continuations joined), comments dropped, shortened when it trains."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        command = line.split("#", 1)[0].strip()
        if command:
            shorter = [extra for script, extra in SHORTER.items() if script in command and "--dry-run" not in command]
            commands.append(" ".join([command, *shorter]))
    return commands


def test_docs_order_names_every_page_of_docs():
    assert sorted(DOCS_ORDER) == sorted(p.name for p in (REPO / "docs").glob("*.md")), (
        "add the new page of docs/ to DOCS_ORDER (and to docs/README.md's index), where its commands can run"
    )


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The repository's files (tracked and new, not ignored) in a fresh directory, and the
    environment of an activated .venv."""
    root = tmp_path_factory.mktemp("readme") / "repo"
    files = (
        subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{venv_bin}:{os.environ['PATH']}",
        "VIRTUAL_ENV": str(Path(venv_bin).parent),
        "OMP_NUM_THREADS": "2",
        "WANDB_MODE": "disabled",
    }
    return root, env


def with_free_port(command: str) -> str:
    """A launcher command on a free rendezvous port: the default 29500 collides with any other launch
    on the machine (the other lane, a second test run)."""
    return command.replace("deepspeed --num_gpus", f"deepspeed --master_port {free_port()} --num_gpus")


def without_launcher(command: str) -> str:
    """A one-rank launch as ``python`` runs it, on a free rendezvous port: the script joins a one-rank
    group itself, and the launcher's two processes add ~7 s of start and exit and nothing else
    (tests/helpers.py launch)."""
    if not command.startswith(ONE_RANK):
        return command
    return f"MASTER_PORT={free_port()} python {command.removeprefix(ONE_RANK)}"


def python_arguments(command: str) -> list[str] | None:
    """A plain ``python ...`` command's arguments after ``python`` (None for anything else: a
    launcher, a pipe, a redirection, a variable)."""
    words = shlex.split(command)
    if words[0] != "python" or any(c in command for c in "|&;<>$`"):
        return None
    return words[1:]


def run_lane(root: Path, env: dict[str, str], lane: list[tuple[str, str]], as_written: str) -> None:
    """Run ``(page, command)`` pairs in order; fail on the first that does not exit 0. The lane's
    plain ``python`` commands run one after another in one interpreter
    (tests/scripts/python_commands.py: the imports paid once), the others in bash, one-rank launches
    other than ``as_written`` without the launcher."""
    interpreter = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "scripts" / "python_commands.py")],
        cwd=root,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert interpreter.stdin and interpreter.stdout
    try:
        for page, command in lane:
            arguments = python_arguments(command)
            if arguments is not None:
                interpreter.stdin.write(json.dumps(arguments) + "\n")
                interpreter.stdin.flush()
                answer = json.loads(interpreter.stdout.readline() or '{"rc": -1, "output": "the interpreter died"}')
                rc, output = answer["rc"], answer["output"]
            else:
                result = subprocess.run(
                    ["bash", "-c", with_free_port(command if command == as_written else without_launcher(command))],
                    cwd=root,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                rc, output = result.returncode, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            assert rc == 0, f"{page}: {command}\n{output[-6000:]}"
    finally:
        interpreter.stdin.close()
        interpreter.wait(timeout=60)


@pytest.fixture(scope="module")
def ran_readme(clone):
    """Every command, in page order; a command repeating an earlier one (a guide repeating the demo's
    step) is not run again. The commands of SECOND_LANE, which share no file with the others,
    run in a second lane beside them (two processes at a time: the machine's two cores)."""
    root, env = clone
    readme_blocks = fenced_blocks(REPO / "README.md", "bash")
    assert readme_blocks[0].startswith("make setup")
    blocks = [("README.md", block) for block in readme_blocks[1:]]
    blocks += [(f"docs/{page.name}", block) for page in pages()[1:] for block in fenced_blocks(page, "bash")]
    ran = [(page, command) for page, block in blocks for command in shell_commands(block)]
    firsts: list[tuple[str, str]] = []
    for page, command in ran:
        if all(command != done for _, done in firsts):
            firsts.append((page, command))
    as_written = next(command for _, command in firsts if command.startswith(ONE_RANK))
    lanes = [[pc for pc in firsts if any(s in pc[1] for s in SECOND_LANE) == second] for second in (False, True)]
    with ThreadPoolExecutor(len(lanes)) as pool:
        for lane in [pool.submit(run_lane, root, env, lane, as_written) for lane in lanes]:
            lane.result()
    return root, env, ran


def test_every_shell_command_runs_as_written(ran_readme):
    root, _, ran = ran_readme
    assert any("train/train_ppo.py" in c and "--dry-run" not in c for page, c in ran if page == "docs/demo.md")
    guides = {page for page, _ in ran if page != "README.md"}
    assert {
        "docs/data.md",
        "docs/own-model.md",
        "docs/sft.md",
        "docs/reward-model.md",
        "docs/ppo.md",
        "docs/lora.md",
    } <= guides
    assert '"Qwen2ForCausalLM"' in (root / "runs/own/model/config.json").read_text()
    for made in (
        "runs/demo/sft/model/model.safetensors",
        "runs/demo/rm/model/reward_stats.json",
        "runs/demo/ppo/actor/model.safetensors",
        "runs/demo/ppo/report.html",
        # a Qwen2-architecture model and UltraFeedback / GSM8K layouts, as a user brings them
        "runs/own/model/config.json",
        "runs/own/rm/model/reward_stats.json",
        "runs/own/dpo/model/model.safetensors",
        "runs/own/grpo/actor/model.safetensors",
    ):
        assert (root / made).is_file(), made


def dry_run(root: Path, env: dict[str, str], script: str, config: dict, name: str) -> subprocess.CompletedProcess:
    (root / name).write_text(json.dumps(config))
    return subprocess.run(
        [sys.executable, script, "--config", name, "--dry-run"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def misspelled(config: dict) -> tuple[dict, str, str]:
    """The config with its first train key's last letter lost, the key, and the misspelling."""
    train = config["train"]
    key = next(iter(train))
    typo = key[:-1]
    return {**config, "train": {typo if k == key else k: v for k, v in train.items()}}, key, typo


def test_every_config_example_dry_runs_with_its_values_and_refuses_a_misspelled_key(ran_readme):
    root, env, _ = ran_readme
    examples = [(page, json.loads(text)) for page in pages() for text in fenced_blocks(page, "json")]
    assert sorted(str(page.relative_to(REPO)) for page, _ in examples) == sorted(EXAMPLE_SCRIPTS)
    scripts = [EXAMPLE_SCRIPTS[str(page.relative_to(REPO))] for page, _ in examples]
    with ThreadPoolExecutor(2) as pool:  # the plans, two processes at a time
        plans = list(
            pool.map(lambda i: dry_run(root, env, scripts[i], examples[i][1], f"example{i}.json"), range(len(examples)))
        )
    for i, ((page, config), script, plan) in enumerate(zip(examples, scripts, plans)):
        assert plan.returncode == 0 and f"dry run of {Path(script).name}" in plan.stdout, (page, plan.stderr[-3000:])
        # The plan states the example's own values: the step size, the token budget, the ZeRO stage of
        # its DeepSpeed file, and as many steps as its epochs make.
        train = config["train"]
        per_step = next(key for key in train if key.endswith("_per_step"))
        deepspeed = config["deepspeed"]
        if isinstance(deepspeed, str):  # a file name, looked up in ds_configs/ as the loader does
            deepspeed = json.loads((root / "ds_configs" / deepspeed).read_text())
        stage = deepspeed["zero_optimization"]["stage"]
        for stated in (
            f"{train[per_step]} {per_step.removesuffix('_per_step')} per step",
            f"(budget {train['max_tokens_per_micro_batch']} tokens, packed)",
            f"ZeRO-{stage}, 1 rank(s)",
        ):
            assert stated in plan.stdout, (page, stated, plan.stdout)
        steps = re.search(r"(\d+) steps per epoch, (\d+) steps", plan.stdout)
        total = train.get("epochs", 1) * int(steps[1]) if steps else -1
        assert steps and int(steps[2]) == min(total, train.get("max_steps") or total), (page, plan.stdout)
        # The same example with a key misspelled (its last letter lost) is refused by name, before any model
        # loads (in process: a launched script's exit 2 on a bad key is tests/test_train_*.py's).
        typo_config, key, typo = misspelled(config)
        (root / f"typo{i}.json").write_text(json.dumps(typo_config))
        with pytest.raises(ConfigError, match=rf"unknown key 'train.{typo}'.*did you mean '{key}'"):
            load_config(SCRIPT_CONFIGS[Path(script).stem], str(root / f"typo{i}.json"))


def heading_anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives a page's headings."""
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in page.read_text().splitlines()
        if line.startswith("#")
    }


def test_every_link_between_pages_resolves():
    """A relative link of the README or a guide names a file that exists, and a heading of it where
    it names an #anchor (a page moved or a heading renamed breaks no link)."""
    broken = []
    for page in [*pages(), REPO / "ds_configs" / "examples" / "README.md"]:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = link.partition("#")
            if link.startswith(("http://", "https://")):
                continue
            target = (page.parent / path).resolve() if path else page
            if not target.exists() or (anchor and target.suffix == ".md" and anchor not in heading_anchors(target)):
                broken.append(f"{page.relative_to(REPO)}: {link}")
    assert not broken, broken
