"""train/train_dpo.py end to end as the deepspeed launcher starts it (2 ranks, CPU, gloo, tiny model),
its resume, and the step and evaluation on one rank, all against a naive padded computation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_repeats, launch, metric_series
from scripts.naive_pairs import naive_losses, padded_response_logprobs
from transformers import AutoTokenizer

from engine.data.preferences import load_preferences
from engine.dpo.reference import TOP_K, ReferenceLogprobs
from engine.dpo.training import PreferenceLossSettings, dpo_step, evaluate_preferences
from engine.models.loading import load_causal_lm
from engine.observe.records import read_records
from engine.observe.report import expected_plots

STEPS, EVERY, PAIRS_PER_STEP, BUDGET = 6, 3, 16, 200  # several micro-batches per rank and step


def write_dpo_config(path: Path, model_dir: Path, data: Path, output_dir: Path, **dpo) -> Path:
    config = {
        "model": {"path": str(model_dir)},
        "data": {"train": str(data / "train.parquet"), "validation": str(data / "validation.parquet")},
        "deepspeed": "tiny_cpu_zero3.json",
        "dpo": {"loss": "dpo", "beta": 0.5, **dpo},
        "train": {
            "pairs_per_step": PAIRS_PER_STEP,
            "max_tokens_per_micro_batch": BUDGET,
            "max_steps": STEPS,
            "eval_every_steps": EVERY,
        },
        "optim": {"lr": 2e-3, "warmup_ratio": 0.0},
        "checkpoint": {"every_steps": EVERY, "keep_last": 2},
        "logging": {"output_dir": str(output_dir), "progress_bar": False, "wandb": False},
    }
    path.write_text(json.dumps(config))
    return path


def naive_evaluation(policy, start, examples, settings: PreferenceLossSettings) -> dict[str, float]:
    """The held-out metrics from padded whole-sequence forwards of the policy and the initial model;
    the KL over the reference's top-k tokens and the rest, and over the whole vocabulary."""
    with torch.no_grad():
        rows, ref_rows = (padded_response_logprobs(m, examples) for m in (policy, start))
        reference = torch.stack([r.sum() for r in ref_rows]).view(-1, 2)
        loss, chosen, rejected = naive_losses(rows, reference, settings.loss, settings.beta, 0.0, 0.0)
        top_k, exact, tokens = 0.0, 0.0, 0
        for e in examples:
            for ids in (e.chosen_ids, e.rejected_ids):
                x, at = torch.tensor([ids]), slice(e.prompt_len - 1, -1)
                p, q = (m(input_ids=x).logits[0, at].float().log_softmax(-1) for m in (policy, start))
                exact += (p.exp() * (p - q)).sum().item()
                top = q.topk(TOP_K, dim=-1)
                p_top = p.gather(-1, top.indices)
                p_rest, q_rest = 1 - p_top.exp().sum(-1), 1 - top.values.exp().sum(-1)
                top_k += ((p_top.exp() * (p_top - top.values)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())).sum()
                tokens += len(ids) - e.prompt_len
    return {
        "loss": loss.mean().item(),
        "chosen_reward": chosen.mean().item(),
        "rejected_reward": rejected.mean().item(),
        "acc": (chosen > rejected).float().mean().item(),
        "kl": float(top_k) / tokens,
        "exact_kl": exact / tokens,
    }


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, rm_data, tmp_path_factory):
    """A 6-step DPO run on 2 ranks (ZeRO-3, shared prompts): (root, result)."""
    root = tmp_path_factory.mktemp("dpo_two_ranks")
    config = write_dpo_config(root / "dpo.json", tiny_model_dir, rm_data, root / "run")
    return root, launch("train_dpo.py", config, ranks=2)


def test_two_rank_run_learns_explains_itself_and_matches_a_naive_computation(two_ranks, tiny_model_dir, rm_data):
    root, result = two_ranks
    run = root / "run"
    assert "train_dpo: dpo (beta 0.5), 1900 train / 100 validation pairs, 6 steps, 2 rank(s)" in result.stdout
    assert "validation accuracy" in result.stdout and "KL to the reference" in result.stdout
    records = read_records(str(run / "metrics.jsonl"))
    assert records[0]["step"] == 0 and records[0]["timing/reference_s"] > 0  # the reference pass, once
    steps = [r for r in records if "dpo/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    train_keys = [{k for k in r if not k.startswith("eval/")} for r in steps]
    assert all(keys == train_keys[0] for keys in train_keys)  # stable keys, a line per step
    # Step 1: the policy is the reference, so the loss is log 2 and the implicit rewards are 0.
    assert steps[0]["dpo/loss"] == pytest.approx(0.6931, abs=1e-4) and abs(steps[0]["dpo/margin"]) < 1e-4
    late = steps[-3:]
    assert sum(r["dpo/margin"] for r in late) / 3 > 0.2 and sum(r["dpo/loss"] for r in late) / 3 < 0.65, late
    final = records[-1]
    assert final["eval/acc"] > 0.6 and final["eval/margin"] > 0.1 and final["eval/kl"] > 0, final
    plots = ["loss.png", "accuracy.png", "rewards.png", "logps.png", "lr_grad_norm.png", "throughput.png"]
    assert expected_plots(str(run)) == plots
    assert all((run / "report" / name).read_bytes().startswith(b"\x89PNG") for name in [*plots, "kl.png"])

    # The reference table in the checkpoint is the initial model's, from padded forwards (both ranks).
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    train, validation = (
        load_preferences(str(rm_data / f"{split}.parquet"), tokenizer, [], False) for split in ("train", "validation")
    )
    start = load_causal_lm(str(tiny_model_dir)).eval()
    states = [
        torch.load(run / "checkpoints" / f"step{EVERY:08d}" / f"trainer_state_rank{r}.pt", weights_only=False)
        for r in (0, 1)
    ]
    reference = ReferenceLogprobs()
    reference.load_state_dict(states[0]["reference"])
    torch.testing.assert_close(states[1]["reference"]["train"], reference.train, rtol=0, atol=0)
    with torch.no_grad():
        naive = torch.stack([r.sum() for r in padded_response_logprobs(start, train[:64])]).view(-1, 2)
    torch.testing.assert_close(reference.train[:64], naive, rtol=0, atol=1e-4)

    # The final held-out metrics: the exported policy and the initial model, naively.
    policy = load_causal_lm(str(run / "model")).eval()
    settings = PreferenceLossSettings("dpo", 0.5, 0.0, 0.0)
    expected = naive_evaluation(policy, start, validation, settings)
    for key in ("loss", "chosen_reward", "rejected_reward", "acc", "kl"):
        assert final[f"eval/{key}"] == pytest.approx(expected[key], abs=1e-5), key
    # A lower bound of the exact KL (loose for this untrained model's flat distributions; the demo's SFT
    # policy: 0.330 of 0.377 nats/token, docs/dpo.md).
    assert 0 < final["eval/kl"] <= expected["exact_kl"] + 1e-6


def test_a_resumed_run_repeats_the_steps_and_keeps_the_reference(two_ranks, tmp_path):
    """A copy of the run resumed from its step-3 checkpoint on 2 ranks repeats steps 4-6 and the
    final evaluation; the reference comes from the checkpoint (no second pass)."""
    root, _ = two_ranks
    copy = tmp_path / "run"
    shutil.copytree(root / "run", copy)
    shutil.rmtree(copy / "model")
    config = json.loads((root / "dpo.json").read_text())
    config["logging"]["output_dir"] = str(copy)
    (tmp_path / "dpo.json").write_text(json.dumps(config))
    result = launch("train_dpo.py", tmp_path / "dpo.json", "--resume", ranks=2)
    assert f"resumed at step {EVERY}" in result.stdout
    for key in ("dpo/loss", "dpo/acc", "dpo/chosen_reward", "eval/acc", "eval/kl"):
        assert_repeats(metric_series(copy, key), metric_series(root / "run", key), what=key)
    assert sum("timing/reference_s" in r for r in read_records(str(copy / "metrics.jsonl"))) == 1


@pytest.mark.parametrize("share_prompt", [False, True])
def test_one_rank_step_and_evaluation_equal_a_naive_padded_computation(
    deepspeed_ready, tiny_model_dir, rm_data, share_prompt
):
    """dpo_step's metrics (DPO with label smoothing, IPO, SimPO) and evaluate_preferences on one rank
    through a real ZeRO-2 engine, against padded whole-sequence forwards (fp32, 1e-5); LoRA: the
    reference pass runs with the adapters off."""
    from engine.models.deepspeed_glue import initialize_training_engine, training_ds_config
    from engine.models.lora import add_adapters
    from engine.run_config import LoraSection

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = load_preferences(str(rm_data / "validation.parquet"), tokenizer, [], False, share_prompt)[:12]
    ds_config = training_ds_config(json.loads((REPO / "ds_configs" / "tiny_cpu_zero2.json").read_text()), False)
    model = add_adapters(load_causal_lm(str(tiny_model_dir)), LoraSection(rank=4), causal_lm=True)
    with torch.no_grad():  # adapters that change the policy: the reference must still be the base model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    engine = initialize_training_engine(
        model,
        ds_config,
        lr=1e-30,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        lr_scheduler="constant_with_warmup",
        warmup_steps=0,
        total_steps=10,
    )
    base = load_causal_lm(str(tiny_model_dir)).eval()
    reference = ReferenceLogprobs()
    engine.eval()
    reference.compute(engine, pairs, pairs, max_tokens=BUDGET, pad_token_id=0)
    with torch.no_grad():
        ref_rows = padded_response_logprobs(base, pairs)
    naive_ref = torch.stack([r.sum() for r in ref_rows]).view(-1, 2)
    torch.testing.assert_close(reference.train, naive_ref, rtol=0, atol=1e-4)
    merged = engine.module
    for settings in (
        PreferenceLossSettings("dpo", 0.5, 0.1, 0.0),
        PreferenceLossSettings("ipo", 0.5, 0.0, 0.0),
        PreferenceLossSettings("simpo", 2.0, 0.0, 0.5),
    ):
        engine.train()
        got = dpo_step(engine, pairs, reference.train, settings, BUDGET, 0, step=1)
        with torch.no_grad():
            rows = padded_response_logprobs(merged, pairs)
        loss, chosen, rejected = naive_losses(
            rows, naive_ref, settings.loss, settings.beta, settings.label_smoothing, settings.simpo_gamma
        )
        for key, value in (("loss", loss), ("chosen_reward", chosen), ("rejected_reward", rejected)):
            assert got[key] == pytest.approx(value.mean().item(), abs=1e-5), (settings.loss, key)
        assert got["acc"] == pytest.approx((chosen > rejected).float().mean().item())
    engine.eval()
    held_out = evaluate_preferences(engine, pairs, reference, PreferenceLossSettings("dpo", 0.5, 0.0, 0.0), BUDGET, 0)
    loss, chosen, rejected = naive_losses(rows, naive_ref, "dpo", 0.5, 0.0, 0.0)
    assert held_out["loss"] == pytest.approx(loss.mean().item(), abs=1e-5)
    assert held_out["margin"] == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)
    naive = naive_evaluation(merged, base, pairs, PreferenceLossSettings("dpo", 0.5, 0.0, 0.0))
    assert held_out["kl"] == pytest.approx(naive["kl"], rel=1e-3) and 0 < held_out["kl"] < naive["exact_kl"]


def test_the_plan_names_the_loss_and_the_reference_pass(tiny_model_dir, rm_data, tmp_path, capsys):
    """What --dry-run prints (the script's own dry run runs in tests/test_readme.py's config examples)."""
    from engine.config import load_config
    from engine.models.deepspeed_glue import training_ds_config
    from engine.run.dry_run import dpo_plan
    from engine.run_config import DPOConfig

    path = write_dpo_config(tmp_path / "dpo.json", tiny_model_dir, rm_data, tmp_path / "run", loss="simpo")
    cfg = load_config(DPOConfig, str(path), ["--model.lora.rank", "8"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    train, validation = (
        load_preferences(str(rm_data / f"{split}.parquet"), tokenizer, [], False, True)
        for split in ("train", "validation")
    )
    assert dpo_plan(cfg, train, validation, training_ds_config(cfg.deepspeed, False), 2) == 0
    plan = capsys.readouterr().out
    assert "dry run of train_dpo.py (2 rank(s))" in plan and "the prompt once" in plan
    assert "schedule: 16 pairs per step, 119 steps per epoch, 6 steps" in plan
    assert "loss: simpo (beta 0.5, gamma 1.0)" in plan
    assert "reference: log-probs of 100 pairs in one pass before the first step (validation; no reference copy " in plan
    assert "the adapters off)" in plan and "(LoRA rank 8:" in plan
