"""The 8-GPU guide (ds_configs/examples/README.md) runs as written: each of its launch commands, its
variables set to Llama-3-8B-shaped model directories and data, dry-runs on the 8 ranks it launches and
its plan says it fits the devices the line names (8 x 80 GiB, the LoRA recipes 8 x 24 GiB). Every
recipe of the folder has its dry run there, before the run line it checks. The model directories hold
no weights (tests/real_shape.py): what a dry run reads of them is a real checkpoint's."""

from __future__ import annotations

import itertools
import json
import re
import runpy
import shlex
import sys
from string import Template

import pytest
from helpers import REPO
from real_shape import hollow_model_dirs
from test_readme import fenced_blocks

from data_prep import prepare_prompts

EXAMPLES = REPO / "ds_configs" / "examples"
GUIDE = EXAMPLES / "README.md"
DRY_RUN = re.compile(r" --dry-run --device-memory-gib (\d+)$")


def guide_lines() -> tuple[dict[str, str], list[str]]:
    """The guide's ```text blocks: the variables it sets (``NAME=value``) and its launch commands
    (continuations joined), in order; comments dropped."""
    variables, commands = {}, []
    for block in fenced_blocks(GUIDE, "text"):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split("#", 1)[0].split())
            if re.fullmatch(r"[A-Z]+=\S+", line):
                name, value = line.split("=")
                variables[name] = value
            elif line:
                commands.append(line)
    return variables, commands


VARIABLES, COMMANDS = guide_lines()
DRY_RUNS = [c for c in COMMANDS if DRY_RUN.search(c)]


def config_of(command: str) -> str:
    return shlex.split(command)[shlex.split(command).index("--config") + 1]


def test_the_guide_dry_runs_each_recipe_before_its_run():
    assert sorted(VARIABLES) == ["BASE", "DATA", "INSTRUCT", "MATH", "OUT"]
    assert all(c.startswith("deepspeed --num_gpus 8 train/train_") for c in COMMANDS), COMMANDS
    assert sorted(config_of(c) for c in DRY_RUNS) == sorted(
        str(p.relative_to(REPO)) for p in EXAMPLES.glob("*.json")
    ), "each recipe's dry run and run in the guide"
    runs = [c for c in COMMANDS if c not in DRY_RUNS]
    assert [DRY_RUN.sub("", c) for c in DRY_RUNS] == runs  # the run, as its dry run checked it
    assert [c for pair in zip(DRY_RUNS, runs) for c in pair] == COMMANDS  # each dry run just before its run
    for command in DRY_RUNS:  # the configs hold the variables' values, the paths the commands set
        config = json.loads((REPO / config_of(command)).read_text())
        words = Template(command).substitute(VARIABLES).split()
        for key, value in itertools.pairwise(words):
            section, _, name = key.removeprefix("--").partition(".")
            if key.startswith("--") and name in config.get(section, {}):
                assert config[section][name] == value, (config_of(command), key)


@pytest.fixture(scope="module")
def shaped(tmp_path_factory, synthetic_pairs, rm_data, sft_data) -> dict[str, str]:
    """The guide's variables: Llama-3-8B-shaped base and Instruct models, the data each script reads,
    and an output directory holding the SFT and reward models the later stages start from."""
    root = tmp_path_factory.mktemp("llama3_8b_shape")
    policy, reward = hollow_model_dirs(root, synthetic_pairs)
    problems = root / "problems.jsonl"
    problems.write_text(
        "".join(json.dumps({"question": f"What is {a} + {a}?", "answer": f"#### {2 * a}"}) + "\n" for a in range(80))
    )
    argv = ["--input", str(problems), "--tokenizer", str(policy), "--out", str(root / "math")]
    assert (
        prepare_prompts.main([*argv, "--prompt-column", "question", "--fields", "answer", "--extract", "answer=gsm8k"])
        == 0
    )
    data = root / "chat"
    data.mkdir()
    for source in (*sft_data.glob("sft_*.parquet"), *rm_data.glob("*.parquet")):
        (data / source.name).symlink_to(source)
    out = root / "out"
    for stage, model in (("sft", policy), ("rm", reward)):
        (out / stage).mkdir(parents=True)
        (out / stage / "model").symlink_to(model)
    return {
        "BASE": str(policy),
        "INSTRUCT": str(policy),
        "DATA": str(data),
        "MATH": str(root / "math"),
        "OUT": str(out),
    }


@pytest.mark.parametrize("command", DRY_RUNS, ids=[config_of(c).split("/")[-1] for c in DRY_RUNS])
def test_each_command_of_the_guide_fits_the_devices_it_names(command, shaped, monkeypatch, capsys):
    words = shlex.split(Template(command).substitute(shaped))
    script, argv, gib = words[3], words[4:], DRY_RUN.search(command)[1]
    monkeypatch.setenv("WORLD_SIZE", "8")  # the ranks a dry run plans for (it starts no process group)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    main = runpy.run_path(str(REPO / script))["main"]
    assert main() == 0
    plan = capsys.readouterr().out
    assert f"dry run of {script.removeprefix('train/')} (8 rank(s))" in plan
    rm = script.endswith("_rm.py")
    assert ("7,504,928,769 parameters" if rm else "8,030,261,248 parameters") in plan  # Llama-3-8B (RM: no LM head)
    assert gib == ("24" if "_lora_24gib" in command else "80")
    assert f"fits {gib} GiB: yes" in plan, plan
