"""The recipes at real shape (ds_configs/examples/): each dry-runs at Llama-3-8B's shape on the ranks and
devices it is written for (8 x 80 GiB, the LoRA ones 8 x 24 GiB) and its plan says it fits. The model
directories hold no weights (tests/real_shape.py): what a dry run reads of them is a real checkpoint's."""

from __future__ import annotations

import json
import runpy
import sys

import pytest
from helpers import REPO
from real_shape import hollow_model_dirs

from data_prep import prepare_prompts

EXAMPLES = REPO / "ds_configs" / "examples"
DEVICE_GIB = {"": 80, "_lora_24gib": 24}


@pytest.fixture(scope="module")
def shaped(tmp_path_factory, synthetic_pairs, rm_data, sft_data):
    """Llama-3-8B-shaped policy and reward model directories, and the data each script reads."""
    root = tmp_path_factory.mktemp("llama3_8b_shape")
    policy, reward = hollow_model_dirs(root, synthetic_pairs)
    problems = root / "problems.jsonl"
    problems.write_text(
        "".join(json.dumps({"question": f"What is {a} + {a}?", "answer": f"#### {2 * a}"}) + "\n" for a in range(80))
    )
    argv = ["--input", str(problems), "--tokenizer", str(policy), "--out", str(root / "gsm8k")]
    assert (
        prepare_prompts.main([*argv, "--prompt-column", "question", "--fields", "answer", "--extract", "answer=gsm8k"])
        == 0
    )
    pairs = ["--data.train", str(rm_data / "train.parquet"), "--data.validation", str(rm_data / "validation.parquet")]
    sft = [
        "--data.train",
        str(sft_data / "sft_train.parquet"),
        "--data.validation",
        str(sft_data / "sft_validation.parquet"),
    ]
    ppo = ["--actor.path", str(policy), "--data.eval_prompts", str(rm_data / "prompts_validation.parquet")]
    return {
        "sft": ["--model.path", str(policy), *sft],
        "rm": ["--model.path", str(policy), *pairs],
        "dpo": ["--model.path", str(policy), *pairs],
        "ppo": [*ppo, "--reward_model.path", str(reward), "--data.prompts", str(rm_data / "prompts_train.parquet")],
        "grpo_math": [
            *ppo[:2],
            *("--data.prompts", str(root / "gsm8k" / "prompts_train.parquet")),
            *("--data.eval_prompts", str(root / "gsm8k" / "prompts_validation.parquet")),
        ],
    }


@pytest.mark.parametrize("config", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_each_recipe_fits_the_devices_it_is_written_for(config, shaped, monkeypatch, capsys):
    recipe = config.removeprefix("llama3_8b_").removesuffix(".json")
    kind = recipe.removesuffix("_lora_24gib")
    gib = DEVICE_GIB[recipe.removeprefix(kind)]
    script = {"grpo_math": "ppo"}.get(kind, kind)
    argv = ["--config", str(EXAMPLES / config), "--dry-run", "--device-memory-gib", str(gib), *shaped[kind]]
    monkeypatch.setenv("WORLD_SIZE", "8")  # the ranks a dry run plans for (it starts no process group)
    monkeypatch.setattr(sys, "argv", [f"train_{script}.py", *argv])
    main = runpy.run_path(str(REPO / "train" / f"train_{script}.py"))["main"]
    assert main() == 0
    plan = capsys.readouterr().out
    assert f"dry run of train_{script}.py (8 rank(s))" in plan
    assert (
        "8,030,261,248 parameters" if kind != "rm" else "7,504,928,769 parameters"
    ) in plan  # Llama-3-8B (RM: no LM head)
    assert f"fits {gib} GiB: yes" in plan, plan
