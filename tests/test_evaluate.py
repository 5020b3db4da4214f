"""train/evaluate.py: pass@k (engine/evaluate/pass_at_k.py) against hand-computed values and the
binomial formula, and the command end to end on the suite's real models (vLLM in this process): a
model against itself under the reward model (win rate 0.5, the same scores), pass@k under a verifier
consistent with the per-sample file, greedy pass@1 equal to engine/rewards/exact_match.py's HF greedy
figure with the same responses, and refusals by name before any model loads."""

from __future__ import annotations

import json
import math
import os
import runpy
from pathlib import Path

import pytest
from helpers import FORKING_PYTHON, REPO, free_port
from test_exact_match import PROBLEM, fitted_model

from data_prep import prepare_prompts
from engine.config import ConfigError
from engine.data.errors import DataFileError
from engine.evaluate.pass_at_k import mean_pass_at_k, pass_at_k, reported_ks
from engine.evaluate.settings import parse_settings
from engine.rewards import exact_match
from engine.rewards.verifiers import format_reward, math_reward
from engine.run.launch import RunRefused

POSITIVE = r"\b(warm|pleasant|kind)\b"  # words of the synthetic task the reward model prefers


def test_pass_at_k_against_hand_computed_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # 1 - C(3,1)/C(5,1)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5) = 11/12
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(4, 0, 2) == 0.0 and pass_at_k(1, 1, 1) == 1.0
    for n in range(1, 9):  # the stable product against the binomial formula itself
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert mean_pass_at_k([[True, False], [False, False]], 1) == 0.25
    assert mean_pass_at_k([[True, False], [False, False]], 2) == 0.5
    assert reported_ks(1) == [1] and reported_ks(6) == [1, 2, 4, 6] and reported_ks(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_every_flag_is_described(capsys):
    with pytest.raises(SystemExit) as exit:
        parse_settings(["--help"], "evaluate.py", "")
    assert exit.value.code == 0
    assert "--max-new-tokens" in capsys.readouterr().out


def evaluate(*argv: str) -> int:
    """train/evaluate.py's main in this process (train/ is no package: the script is run by path)."""
    return runpy.run_path(str(REPO / "train" / "evaluate.py"))["main"]([str(a) for a in argv])


def read(out: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((out / "summary.json").read_text())
    return summary, [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_evaluation_end_to_end(process_group, sft_run, rm_run, rm_data, tmp_path, monkeypatch, capsys):
    # The rendezvous of an in-process group; monkeypatch restores them, so that no later launch inherits
    # this process's port (join_world would set MASTER_PORT for good, and its store keeps the port bound).
    rendezvous = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for name, value in (rendezvous | {"MASTER_PORT": str(free_port())}).items():
        monkeypatch.setenv(name, value)
    sft, rm = sft_run[0] / "run" / "model", rm_run[0] / "run" / "model"
    prompts = rm_data / "prompts_validation.parquet"

    # The SFT model against itself, 4 samples a prompt: the reward model and a format verifier score them.
    out = tmp_path / "self"
    flags = ["--samples", 4, "--max-new-tokens", 16, "--seed", 3, "--verifier", "format", "--pattern", POSITIVE]
    flags += ["--baseline", sft, "--reward-model", rm]
    assert evaluate("--model", sft, "--prompts", prompts, "--out", out, *flags) == 0
    summary, rows = read(out)
    assert json.loads(capsys.readouterr().out.splitlines()[-2]) == summary
    model, baseline = summary["model"], summary["baseline"]
    n_prompts = summary["prompt_count"]
    assert len(rows) == 2 * 4 * n_prompts and summary["sampling"]["samples"] == 4
    mine = [r for r in rows if r["policy"] == "model"]
    theirs = [r for r in rows if r["policy"] == "baseline"]
    assert [(r["prompt_index"], r["sample"]) for r in mine] == [(i, j) for i in range(n_prompts) for j in range(4)]
    assert [r["response"] for r in mine] == [r["response"] for r in theirs]  # the same seed: the same draw
    assert len({r["response"] for r in mine}) > n_prompts  # sampled: the 4 responses of a prompt differ
    assert summary["win_rate"] == 0.5 and model["rm_score"] == baseline["rm_score"]  # all ties, counted half
    assert model["rm_score"] == pytest.approx(sum(r["rm_score"] for r in mine) / len(mine))
    assert all(r["correct"] == (format_reward(r["response"], POSITIVE) == 1.0) for r in mine)
    assert all(r["components"]["format"] == r["reward"] == float(r["correct"]) for r in mine)
    correct = [[r["correct"] for r in mine[i * 4 : (i + 1) * 4]] for i in range(n_prompts)]
    assert model["pass@1"] == pytest.approx(sum(map(sum, correct)) / len(mine))
    assert model["pass@4"] == pytest.approx(sum(map(any, correct)) / n_prompts)  # k = n: any of the n
    assert 0 < model["pass@1"] < model["pass@2"] < model["pass@4"] < 1
    assert model["reward"] == pytest.approx(model["pass@1"]) and model["finished"] > 0.5

    # Greedy, one sample: pass@1 is exact_match's HF greedy accuracy, with the very same responses.
    fitted, tokenizer, fitted_lm = fitted_model(tmp_path)
    rows_file = tmp_path / "problems.jsonl"
    problems = [
        (PROBLEM, "12"),
        (PROBLEM.replace("Mia", "Ava"), "12"),
        (PROBLEM.replace("Mia", "Zoe"), "13"),
        ("Hi", "9"),
    ]
    rows_file.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in problems))
    data_flags = ["--fields", "answer", "--validation-fraction", "1", "--tokenizer", str(fitted)]
    assert prepare_prompts.main(["--input", str(rows_file), *data_flags, "--out", str(tmp_path / "data")]) == 0
    answered = tmp_path / "data" / "prompts_validation.parquet"
    greedy = tmp_path / "greedy"
    common = ["--prompts", answered, "--verifier", "math", "--max-new-tokens", 16]
    assert evaluate("--model", fitted, *common, "--temperature", 0, "--out", greedy) == 0
    summary, rows = read(greedy)
    messages = [[{"role": "user", "content": p}] for p, _ in problems]  # prepare_prompts keeps the row order
    answers = [a for _, a in problems]
    assert [r["prompt"] for r in rows] == messages
    assert [r["response"] for r in rows] == exact_match.greedy_responses(fitted_lm, tokenizer, messages, 16)
    assert [r["correct"] for r in rows] == [math_reward(r["response"], a) == 1.0 for r, a in zip(rows, answers)]
    accuracy = exact_match.greedy_accuracy(str(fitted), messages, answers, max_new_tokens=16)
    assert summary["model"]["pass@1"] == accuracy and 0 < accuracy < 1
    assert "rm_score" not in summary["model"] and "baseline" not in summary

    # Refusals by name, before any model loads; nothing written.
    with pytest.raises(RunRefused, match=r"--out .*greedy already holds summary.json, samples.jsonl: pass --overwrite"):
        evaluate("--model", fitted, *common, "--temperature", 0, "--out", greedy)
    refused = tmp_path / "refused"
    with pytest.raises(RunRefused, match=r"'--model' \(.*missing\): no tokenizer could be loaded"):
        evaluate("--model", tmp_path / "missing", *common, "--out", refused)
    with pytest.raises(DataFileError, match=r"'answer'.*--verifier math"):
        evaluate("--model", sft, "--prompts", prompts, "--verifier", "math", "--out", refused)
    with pytest.raises(RunRefused, match=r"'--reward-model' .* is not a reward model"):
        evaluate("--model", sft, "--prompts", prompts, "--reward-model", sft, "--out", refused)
    with pytest.raises(ConfigError, match=r"--temperature 0 is greedy: its 4 samples would be one"):
        evaluate("--model", sft, "--prompts", prompts, "--temperature", 0, "--samples", 4, "--out", refused)
    with pytest.raises(ConfigError, match=r"'samples' must be >= 1, got 0"):
        evaluate("--model", sft, "--prompts", prompts, "--samples", 0, "--out", refused)
    with pytest.raises(RunRefused, match=r"--max-new-tokens 100000 .* more than --model"):
        evaluate("--model", sft, "--prompts", prompts, "--max-new-tokens", 100000, "--out", refused)
    assert not refused.exists()
    # As a command: exit 2 and the message, no traceback.
    argv = [str(REPO / "train" / "evaluate.py"), "--model", str(sft), "--prompts", str(prompts), "--out", str(refused)]
    result = FORKING_PYTHON.run([{"argv": [*argv, "--verifier", "math"], "env": dict(os.environ)}], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "data error:" in result.stderr and "Traceback" not in result.stderr
