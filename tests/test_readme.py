"""The README works as written: every command of its shell blocks runs, in order, from the
repository root of a fresh copy, in the environment `make setup` made; every config example
dry-runs on the demo data those commands prepared.

The first block (`make setup`, `make demo`, `make test`) is CI itself (.ci/run runs setup and
test) and the demo. Training commands run shortened (`--train.max_steps 2`, `--train.iterations 1`
appended: the full runs are the demo and the end-to-end tests).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHORTER = {
    "train/train_sft.py": "--train.max_steps 2",
    "train/train_rm.py": "--train.max_steps 2",
    "train/train_ppo.py": "--train.iterations 1",
}
EXAMPLE_SCRIPTS = {"Supervised fine-tuning": "train/train_sft.py", "Training a reward model": "train/train_rm.py"}


def fenced_blocks(language: str) -> list[tuple[str, str]]:
    """(the section heading above it, text) of every ```language block of the README, in order."""
    blocks, heading, fence, lines = [], "", None, []
    for line in (REPO / "README.md").read_text().splitlines():
        if fence is None and line.startswith("## "):
            heading = line[3:].strip()
        elif fence is None and line.startswith("```"):
            fence, lines = line[3:].strip(), []
        elif fence is not None and line.strip() == "```":
            if fence == language:
                blocks.append((heading, "\n".join(lines) + "\n"))
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
            commands.append(" ".join([command, *(extra for script, extra in SHORTER.items() if script in command)]))
    return commands


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
    }
    return root, env


@pytest.fixture(scope="module")
def ran_readme(clone):
    root, env = clone
    blocks = fenced_blocks("bash")
    assert blocks[0][1].startswith("make setup") and len(blocks) >= 5
    ran = []
    for _, block in blocks[1:]:
        for command in shell_commands(block):
            result = subprocess.run(
                ["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=600
            )
            assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            ran.append(command)
    return root, env, ran


def test_every_shell_command_runs_as_written(ran_readme):
    root, _, ran = ran_readme
    assert any("train/train_ppo.py" in c and "--dry-run" not in c for c in ran)
    for made in (
        "runs/demo/sft/model/model.safetensors",
        "runs/demo/rm/model/reward_stats.json",
        "runs/demo/ppo/actor/model.safetensors",
        "runs/demo/ppo/report.html",
    ):
        assert (root / made).is_file(), made


def test_every_config_example_runs_on_the_demo_data(ran_readme):
    root, env, _ = ran_readme
    examples = [(heading, json.loads(text)) for heading, text in fenced_blocks("json")]
    assert {heading for heading, _ in examples} == set(EXAMPLE_SCRIPTS)
    for heading, config in examples:
        (root / "example.json").write_text(json.dumps(config))
        result = subprocess.run(
            [sys.executable, EXAMPLE_SCRIPTS[heading], "--config", "example.json", "--dry-run"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0 and "dry run of" in result.stdout, (heading, result.stderr[-3000:])
