"""train/train_rm.py end to end under the real deepspeed launcher (CPU, gloo, tiny model)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    RM_COMPONENTS,
    RM_STEPS,
    assert_repeats,
    assert_same_weights,
    launch,
    launch_two_nodes,
    metric_series,
    write_rm_config,
)
from transformers import AutoTokenizer

from engine.data.preferences import load_preferences
from engine.models.loading import load_value_model
from engine.observe.records import read_records
from engine.observe.report import expected_plots
from engine.rm.losses import pair_losses
from engine.rm.reward_model import PairStats, score_pairs

COMPONENTS = RM_COMPONENTS
STEPS = RM_STEPS


def losses(output_dir: Path) -> dict[int, float]:
    return metric_series(output_dir, "rm/loss")


@pytest.fixture(scope="module")
def one_rank(rm_run):
    return rm_run


def test_reaches_high_validation_accuracy(one_rank):
    root, result = one_rank
    assert "validation accuracy" in result.stdout
    final = read_records(str(root / "run" / "metrics.jsonl"))[-1]
    assert final["eval/acc"] >= 0.9
    assert final["eval/acc_helpful"] > 0.8 and final["eval/acc_harmless"] > 0.8
    assert len(losses(root / "run")) == STEPS
    steps = read_records(str(root / "run" / "metrics.jsonl"))
    assert {"rm/loss", "rm/acc", "rm/margin", "rm/lr", "rm/grad_norm", "timing/tokens_per_s"} <= steps[0].keys()
    assert list((root / "run" / "tensorboard").iterdir()) and list((root / "run" / "wandb").iterdir())


def test_run_directory_explains_itself(one_rank):
    root, result = one_rank
    run = root / "run"
    config = json.loads((run / "config.json").read_text())  # resolved: defaults filled in
    assert config["rm"]["components"] == COMPONENTS and config["guards"]["max_nonfinite_in_a_row"] == 5
    assert f"report: {run}/report.html" in result.stdout
    page = (run / "report.html").read_text()
    assert expected_plots(str(run)) == ["loss.png", "accuracy.png", "margin.png", "lr_grad_norm.png", "throughput.png"]
    for name in expected_plots(str(run)):
        png = (run / "report" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
        assert f'src="report/{name}"' in page
    metrics = read_records(str(run / "metrics.jsonl"))
    train_keys = [{k for k in m if not k.startswith("eval/")} for m in metrics if "rm/loss" in m]
    assert len(train_keys) == STEPS and all(
        keys == train_keys[0] for keys in train_keys
    )  # stable keys, a line per step
    assert (run / "events.jsonl").read_text() == ""


def test_saved_model_reloads_and_scores_identically(one_rank, rm_data):
    root, _ = one_rank
    model_dir = root / "run" / "model"
    stats = json.loads((model_dir / "reward_stats.json").read_text())
    model = load_value_model(str(model_dir), list(COMPONENTS)).eval()
    assert model.config.id2label == {0: "helpful", 1: "harmless"}
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = load_preferences(str(rm_data / "validation.parquet"), tok, list(COMPONENTS), use_margin=True)
    weights = torch.tensor(list(COMPONENTS.values()))
    acc = PairStats(list(COMPONENTS))
    with torch.no_grad():
        for start in range(0, len(examples), 16):
            batch = examples[start : start + 16]
            r_c, r_r = score_pairs(model, batch)
            labels = torch.tensor([e.labels for e in batch])
            acc.add(r_c, r_r, weights, labels, pair_losses(r_c, r_r, weights, torch.zeros(len(batch)), labels))
    reloaded = acc.reduce()
    assert reloaded["reward_mean"] == pytest.approx(stats["mean"], abs=1e-5)
    assert reloaded["reward_std"] == pytest.approx(stats["std"], abs=1e-5)
    final = read_records(str(root / "run" / "metrics.jsonl"))[-1]
    assert reloaded["acc"] == final["eval/acc"]


@pytest.fixture(scope="module")
def two_ranks(rm_two_ranks) -> Path:
    return rm_two_ranks


def test_two_ranks_zero3_follow_the_one_rank_curve(one_rank, two_ranks):
    root, _ = one_rank
    one, two = losses(root / "run"), losses(two_ranks / "run")
    assert sorted(two) == sorted(one)
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-3, abs=1e-4), step


def test_two_nodes_train_exactly_as_two_ranks_on_one_node(two_ranks, tmp_path):
    """One rank on each of two "nodes" (one launcher per node, --no_ssh, as on a cluster):
    the same losses and accuracy and the same exported model (to float rounding: helpers.assert_repeats)."""
    config = json.loads((two_ranks / "rm.json").read_text())
    config["logging"]["output_dir"] = str(tmp_path / "run")
    (tmp_path / "rm.json").write_text(json.dumps(config))
    results = launch_two_nodes("train_rm.py", tmp_path / "rm.json", tmp_path, "--checkpoint.every_steps", "0")
    assert "train_rm:" in results[0].stdout and "2 rank(s)" in results[0].stdout
    for key in ("rm/loss", "rm/acc", "eval/acc"):
        assert_repeats(metric_series(tmp_path / "run", key), metric_series(two_ranks / "run", key), what=key)
    a = load_value_model(str(two_ranks / "run" / "model"), list(COMPONENTS)).state_dict()
    b = load_value_model(str(tmp_path / "run" / "model"), list(COMPONENTS)).state_dict()
    assert_same_weights(a, b)


def test_an_output_dir_the_nodes_do_not_share_is_refused(two_ranks, tmp_path):
    """Each node writing to a directory of its own (no shared filesystem) is refused before any
    model loads: checkpoints are written by every rank and read by every rank on resume."""
    config = json.loads((two_ranks / "rm.json").read_text())
    config["logging"]["output_dir"] = str(tmp_path / "node0")
    (tmp_path / "rm.json").write_text(json.dumps(config))
    results = launch_two_nodes(
        "train_rm.py",
        tmp_path / "rm.json",
        tmp_path,
        node_extra=([], ["--logging.output_dir", str(tmp_path / "node1")]),
        check=False,
    )
    for r in results:
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = results[0].stderr + results[1].stderr
    assert "output error: logging.output_dir" in err and "rank 1 (" in err and "filesystem every node mounts" in err
    assert "Traceback" not in err and "Loading weights" not in err
    assert not (tmp_path / "node0").exists() and not (tmp_path / "node1").exists()


def test_zero3_offload_bf16_and_checkpointing_are_in_effect_and_train(tiny_model_dir, rm_data, tmp_path):
    """The script applies what the config asks (read back from the engine, not the config) and the
    run learns. Each shipped DeepSpeed config's own settings: tests/test_ds_configs.py."""
    config = write_rm_config(tmp_path / "rm.json", tiny_model_dir, rm_data, tmp_path / "run", max_steps=6)
    result = launch(
        "train_rm.py",
        config,
        "--deepspeed",
        "zero3_offload.json",
        "--model.bf16",
        "true",
        "--model.gradient_checkpointing",
        "true",
        "--checkpoint.every_steps",
        "0",
    )
    assert "ZeRO-3, bfloat16 weights, offload: optimizer + parameters, gradient checkpointing on" in result.stdout
    loss = losses(tmp_path / "run")
    assert sorted(loss) == list(range(1, 7)) and all(math.isfinite(v) for v in loss.values())
    assert loss[5] + loss[6] < loss[1] + loss[2], loss
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()


def test_bad_config_is_refused_before_training(tiny_model_dir, rm_data, tmp_path):
    config = write_rm_config(tmp_path / "rm.json", tiny_model_dir, rm_data, tmp_path / "run")
    result = subprocess.run(
        [sys.executable, str(REPO / "train" / "train_rm.py"), "--config", str(config), "--train.pairs_per_stp", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "unknown key '--train.pairs_per_stp' in 'train' (did you mean 'pairs_per_step'?)" in result.stderr
