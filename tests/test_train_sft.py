"""train/train_sft.py end to end as the deepspeed launcher starts it (CPU, gloo, tiny model)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import (
    REPO,
    SFT_EVERY,
    SFT_STEPS,
    TASK_WORDS,
    assert_repeats,
    assert_same_weights,
    launch,
    metric_series,
    write_sft_config,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.observe.records import read_records
from engine.observe.report import expected_plots


def losses(output_dir: Path) -> dict[int, float]:
    return metric_series(output_dir, "sft/loss")


def test_loss_falls_and_the_run_directory_explains_itself(sft_run):
    root, result = sft_run
    run = root / "run"
    loss = losses(run)
    assert sorted(loss) == list(range(1, SFT_STEPS + 1))
    assert sum(loss[s] for s in range(SFT_STEPS - 4, SFT_STEPS + 1)) < 0.6 * sum(loss[s] for s in range(1, 6)), loss
    evals = metric_series(run, "eval/loss")
    assert sorted(evals) == [SFT_EVERY, 2 * SFT_EVERY, SFT_STEPS] and evals[SFT_STEPS] < evals[SFT_EVERY] < 5.0
    assert f"validation loss {evals[SFT_STEPS]:.3f}" in result.stdout
    metrics = read_records(str(run / "metrics.jsonl"))
    assert {
        "sft/loss",
        "sft/perplexity",
        "sft/trained_tokens",
        "sft/lr",
        "sft/grad_norm",
        "timing/tokens_per_s",
    } <= metrics[0].keys()
    assert expected_plots(str(run)) == ["loss.png", "lr_grad_norm.png", "throughput.png"]
    page = (run / "report.html").read_text()
    for name in expected_plots(str(run)):
        assert (run / "report" / name).read_bytes().startswith(b"\x89PNG") and f'src="report/{name}"' in page
    assert (run / "events.jsonl").read_text() == ""


def test_exported_model_writes_the_task_language(sft_run, tiny_model_dir):
    """Sampled from the exported model with transformers: whole words of the task, ending the turn
    with <|im_end|>; the random-init start writes byte soup."""
    root, _ = sft_run

    def sample(path: Path) -> list[str]:
        tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "Tell me about the river in Alder."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        torch.manual_seed(0)
        out = model.generate(ids, do_sample=True, max_new_tokens=24, num_return_sequences=16)
        return [tok.decode(o[ids.shape[1] :]) for o in out]

    texts = sample(root / "run" / "model")
    finished = [t.split("<|im_end|>")[0] for t in texts if "<|im_end|>" in t]
    assert len(finished) >= 12, texts
    words = [w.strip(".") for t in finished for w in t.split()]
    assert sum(w.lower() in TASK_WORDS for w in words) >= 0.85 * len(words), finished
    assert not any("\ufffd" in t for t in finished), finished
    start = sample(tiny_model_dir)
    assert sum("<|im_end|>" in t for t in start) < 4, start


def test_resume_continues_with_identical_losses(sft_run, tmp_path):
    root, _ = sft_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)  # as if it had died after its last checkpoint (older ones: test_crash_resume)
    (run / "model").rename(tmp_path / "first_model")
    config = json.loads((root / "sft.json").read_text())
    config["logging"]["output_dir"] = str(run)
    (tmp_path / "sft.json").write_text(json.dumps(config))
    result = launch("train_sft.py", tmp_path / "sft.json", "--resume")
    assert f"resumed at step {2 * SFT_EVERY}" in result.stdout
    straight, resumed = losses(root / "run"), losses(run)
    assert sorted(resumed) == list(range(1, SFT_STEPS + 1))
    assert_repeats(resumed, straight, range(2 * SFT_EVERY + 1, SFT_STEPS + 1))
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "first_model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(run / "model").state_dict()
    assert_same_weights(a, b)


def test_two_ranks_and_another_packing_follow_the_one_rank_curve(sft_run, tiny_model_dir, sft_data, tmp_path):
    """The loss is a token-mean over the whole mini-batch: 2 ranks with a smaller token budget
    (other micro-batches, other packing) give the same curve."""
    root, _ = sft_run
    config = write_sft_config(
        tmp_path / "sft.json", tiny_model_dir, sft_data, tmp_path / "run", max_tokens_per_micro_batch=300, max_steps=10
    )
    launch("train_sft.py", config, "--checkpoint.every_steps", "0", "--logging.wandb", "false", ranks=2)
    one, two = losses(root / "run"), losses(tmp_path / "run")
    assert sorted(two) == list(range(1, 11))
    for step in two:
        assert two[step] == pytest.approx(one[step], rel=1e-3, abs=1e-4), step


def test_bad_data_and_config_are_refused_before_any_model_loads(tiny_model_dir, sft_data, tmp_path):
    config = write_sft_config(tmp_path / "sft.json", tiny_model_dir, sft_data, tmp_path / "run")
    pq.write_table(pa.table({"prompt": ["hi"]}), tmp_path / "bad.parquet")
    cases = [
        (["--data.train", str(tmp_path / "bad.parquet")], "missing column(s) ['messages']"),
        (["--model.path", str(tmp_path / "nowhere")], "'model.path'"),
    ]
    for extra, message in cases:
        result = subprocess.run(
            [sys.executable, str(REPO / "train" / "train_sft.py"), "--config", str(config), *extra],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_dry_run_prints_the_plan(tiny_model_dir, sft_data, tmp_path):
    config = write_sft_config(tmp_path / "sft.json", tiny_model_dir, sft_data, tmp_path / "run")
    result = subprocess.run(
        [sys.executable, str(REPO / "train" / "train_sft.py"), "--config", str(config), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "dry run of train_sft.py" in result.stdout
        and f"{SFT_STEPS} steps" in result.stdout
        and "policy" in result.stdout
    )
    assert not (tmp_path / "run").exists()
