"""Shared fixtures: the synthetic task, a tiny model built from it, and the real HH file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HH_PATH = REPO.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"

# Quiet, deterministic, offline defaults for everything the tests start (subprocesses inherit).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def synthetic_pairs(tmp_path_factory) -> Path:
    from data_prep import synthetic_task

    path = tmp_path_factory.mktemp("synthetic") / "pairs.jsonl"
    assert synthetic_task.main(["--out", str(path), "--num-pairs", "600", "--seed", "0"]) == 0
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, synthetic_pairs) -> Path:
    from data_prep import make_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    assert make_tiny_model.main(["--text", str(synthetic_pairs), "--out", str(out), "--num-layers", "2"]) == 0
    return out


@pytest.fixture(scope="session")
def tied_tiny_model_dir(tmp_path_factory, synthetic_pairs) -> Path:
    """The tiny model with its LM head tied to its input embedding, as Qwen2.5-0.5B/1.5B have it."""
    from data_prep import make_tiny_model

    out = tmp_path_factory.mktemp("tied") / "model"
    argv = ["--text", str(synthetic_pairs), "--out", str(out), "--num-layers", "2", "--tie-embeddings"]
    assert make_tiny_model.main(argv) == 0
    return out


@pytest.fixture(scope="session")
def process_group(tmp_path_factory):
    """A one-process gloo group in the test process, for engine code that agrees over ranks
    (micro-batch counts, metric sums, barriers); subprocess tests start their own."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0, world_size=1
        )
    yield


@pytest.fixture(scope="session")
def deepspeed_ready(process_group):
    """DeepSpeed engines in the test process, on the one-process group."""
    import deepspeed.ops

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a JIT build otherwise (engine/run/distributed.py)


@pytest.fixture(scope="session")
def hh_path() -> Path:
    if not HH_PATH.is_file():
        pytest.skip(f"real HH-RLHF data not found at {HH_PATH} (it lives in ../shared/data/hh-rlhf/)")
    return HH_PATH


@pytest.fixture(scope="session")
def hh_tokenizer(tmp_path_factory, hh_path) -> Path:
    """A tiny byte-level BPE tokenizer (and 1-layer model) trained on the real HH text."""
    from data_prep import make_tiny_model

    out = tmp_path_factory.mktemp("hh") / "tok"
    assert make_tiny_model.main(["--text", str(hh_path), "--out", str(out), "--num-layers", "1"]) == 0
    return out


@pytest.fixture(scope="session")
def rm_data(tmp_path_factory, tiny_model_dir) -> Path:
    """Synthetic pairs (2,000) prepared with the tiny tokenizer: train/validation/prompts parquet."""
    from data_prep import prepare_preferences, synthetic_task

    root = tmp_path_factory.mktemp("rm_data")
    synthetic_task.main(["--out", str(root / "pairs.jsonl"), "--num-pairs", "2000", "--seed", "1"])
    assert (
        prepare_preferences.main(
            ["--input", str(root / "pairs.jsonl"), "--tokenizer", str(tiny_model_dir), "--out", str(root)]
        )
        == 0
    )
    return root


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory, tiny_model_dir) -> Path:
    """Synthetic demonstrations (1,200) prepared with the tiny tokenizer: sft_{train,validation}.parquet."""
    from data_prep import prepare_sft, synthetic_task

    root = tmp_path_factory.mktemp("sft_data")
    synthetic_task.main(
        [
            "--out",
            str(root / "pairs.jsonl"),
            "--num-pairs",
            "1",
            "--seed",
            "2",
            "--demonstrations-out",
            str(root / "demonstrations.jsonl"),
            "--num-demonstrations",
            "1200",
        ]
    )
    assert (
        prepare_sft.main(
            ["--input", str(root / "demonstrations.jsonl"), "--tokenizer", str(tiny_model_dir), "--out", str(root)]
        )
        == 0
    )
    return root


@pytest.fixture(scope="session")
def rm_two_ranks(tmp_path_factory, tiny_model_dir, rm_data):
    """The reward-model run on one node with two ranks (checkpoints at steps 20 and 40); its config
    is ``rm.json`` beside the run."""
    from helpers import launch, write_rm_config

    root = tmp_path_factory.mktemp("rm_two_ranks")
    launch("train_rm.py", write_rm_config(root / "rm.json", tiny_model_dir, rm_data, root / "run"), ranks=2)
    return root


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory, tiny_model_dir, sft_data):
    """A policy fine-tuned by train_sft.py (1 rank, ZeRO-3): (root with sft.json and run/, result)."""
    from helpers import launch, write_sft_config

    root = tmp_path_factory.mktemp("sft_one_rank")
    result = launch("train_sft.py", write_sft_config(root / "sft.json", tiny_model_dir, sft_data, root / "run"))
    return root, result


@pytest.fixture(scope="session")
def rm_run(tmp_path_factory, tiny_model_dir, rm_data):
    """A reward model trained by train_rm.py (1 rank, ZeRO-3): (root with rm.json and run/, result)."""
    from helpers import launch, write_rm_config

    root = tmp_path_factory.mktemp("rm_one_rank")
    config = write_rm_config(root / "rm.json", tiny_model_dir, rm_data, root / "run")
    with_wandb = json.loads(config.read_text())
    with_wandb["logging"]["wandb"] = True  # the one run that checks the offline wandb run (others skip its start)
    config.write_text(json.dumps(with_wandb))
    return root, launch("train_rm.py", config)
