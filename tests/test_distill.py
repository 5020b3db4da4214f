"""On-policy distillation (the ``distill`` section of train/train_ppo.py): the teacher's log-probs and
top-k of a rollout and the actor's GKD term against naive whole-sequence forwards
(engine/ppo/distill.py, engine/ppo/update.py); end to end on the tiny model, the teacher and GKD's
dataset responses refused by name before any model loads, the dry run's teacher, one run whose
teacher is the student itself, resumed, and one GKD run with dataset responses (lmbda < 1). (The
formulas: tests/test_distill_losses.py; the draw and the dataset responses' ids:
tests/test_dataset_responses.py; the chunked head: tests/test_lm_head.py.)"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import assert_repeats, launch, metric_series, run_script, write_ppo_config
from safetensors.torch import load_file
from transformers import AutoTokenizer

from data_prep import make_tiny_model
from engine.config import ConfigError, load_config
from engine.data.errors import DataFileError
from engine.data.packing import pack_sequences
from engine.data.prompts import Prompt
from engine.models.loading import load_causal_lm
from engine.observe.records import read_records
from engine.ppo.collect import Rollout
from engine.ppo.distill import DistillSettings, teacher_logprobs
from engine.ppo.distill_losses import reverse_kl_advantages, top_k_jsd
from engine.ppo.engines import HybridEngine
from engine.ppo.experience import Experience, make_experience
from engine.ppo.forwards import ValueReadout, pad_right
from engine.ppo.inputs import load_fitting_prompts
from engine.ppo.losses import PolicyLoss
from engine.ppo.settings import ExperienceSettings, GaeSettings, PolicyLossSettings, UpdateSettings
from engine.ppo.update import actor_forward, actor_token_loss
from engine.rollout.sampler import Sample
from engine.run_config import PPOConfig

ITERATIONS, EVERY = 4, 2


def distill_config(path, actor, teacher, data, output_dir, **overrides):
    """A PPO config that distils ``teacher`` into ``actor`` with no reward at all (GRPO, no critic)."""
    write_ppo_config(
        path,
        actor,
        actor,
        data,
        output_dir,
        rollout__sampler="hf",  # HF generate on the actor: vLLM starts in the runs that test it
        rollout__temperature=0.7,
        ppo__advantage_estimator="grpo",
        ppo__mini_batch_size=32,
        **{"train__iterations": ITERATIONS, "train__eval_every": EVERY, "checkpoint__every_steps": EVERY} | overrides,
    )
    config = json.loads(path.read_text())
    del config["reward_model"]
    config["distill"] = {"teacher": str(teacher), **config.get("distill", {})}
    path.write_text(json.dumps(config))
    return path


def with_responses(data, out):
    """``data``'s prompt files in ``out``, each training prompt with a dataset response (``response``:
    the chosen response of one of its pairs)."""
    chosen = {json.dumps(p["prompt"]): p["chosen"] for p in pq.read_table(data / "train.parquet").to_pylist()}
    prompts = pq.read_table(data / "prompts_train.parquet")
    responses = pa.array([chosen[json.dumps(p)] for p in prompts.column("prompt").to_pylist()])
    out.mkdir()
    pq.write_table(prompts.append_column("response", responses), out / "prompts_train.parquet")
    shutil.copy(data / "prompts_validation.parquet", out)
    return out


def test_a_teacher_is_refused_by_name_before_any_model_loads(tiny_model_dir, rm_data, tmp_path):
    """Another tokenizer, and GKD's dataset responses (lmbda < 1) with mode reverse_kl or from a prompt
    file without them: exit 2, the key named, no traceback; the dry run prices the teacher."""
    other = tmp_path / "other"
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "a wholly other corpus of words " * 50}) + "\n")
    assert make_tiny_model.main(["--text", str(tmp_path / "text.jsonl"), "--out", str(other), "--num-layers", "1"]) == 0
    config = distill_config(tmp_path / "other.json", tiny_model_dir, other, rm_data, tmp_path / "run")
    refused = run_script("train_ppo.py", config)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"config error: 'distill.teacher' ({other}): its vocabulary is not the actor's" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "run").exists()

    config = distill_config(tmp_path / "gkd.json", tiny_model_dir, tiny_model_dir, rm_data, tmp_path / "run")
    refused = run_script("train_ppo.py", config, "--distill.lmbda", "0.5")
    assert refused.returncode == 2 and "distill: 'lmbda': mode gkd's; mode reverse_kl reads none" in refused.stderr
    assert "Traceback" not in refused.stderr
    gkd = load_config(PPOConfig, str(config), ["--distill.mode", "gkd", "--distill.lmbda", "0.5"])
    with pytest.raises(DataFileError, match=r"missing column\(s\) \['response'\]; distill.response_field reads 'res"):
        load_fitting_prompts(gkd.data.prompts, AutoTokenizer.from_pretrained(tiny_model_dir), gkd, rank=0)

    with pytest.raises(ConfigError, match=r"distill: 'beta', 'top_k': mode gkd's; mode reverse_kl reads none"):
        load_config(PPOConfig, str(config), ["--distill.beta", "0.3", "--distill.top_k", "8"])
    assert load_config(PPOConfig, str(config), ["--distill.mode", "gkd", "--distill.beta", "0.3"]).distill

    plan = run_script("train_ppo.py", config, "--dry-run")
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "  teacher  " in plan.stdout and "parameters (frozen)" in plan.stdout.split("  teacher  ")[1]
    assert f"distillation: reverse_kl from {tiny_model_dir}" in plan.stdout


def test_the_student_as_its_own_teacher_learns_nothing_logs_distillation_and_resumes(tiny_model_dir, rm_data, tmp_path):
    """Teacher = student, no reward: the reverse KL to the teacher is 0 on the rollouts and on the
    held-out responses, every advantage is 0, so the exported actor is the start, bit for bit; the
    distillation metrics and plot are there, and a resume from iteration 2 repeats iterations 3-4."""
    config = distill_config(tmp_path / "ppo.json", tiny_model_dir, tiny_model_dir, rm_data, tmp_path / "run")
    result = launch("train_ppo.py", config)
    run = tmp_path / "run"
    reverse_kl = metric_series(run, "distill/reverse_kl")
    assert sorted(reverse_kl) == list(range(1, ITERATIONS + 1)) and max(map(abs, reverse_kl.values())) < 1e-6
    held_out = metric_series(run, "eval/distill/reverse_kl")
    assert sorted(held_out) == [0, 2, 4] and max(map(abs, held_out.values())) < 1e-6
    teacher = metric_series(run, "distill/teacher_logprob")
    assert sorted(teacher) == sorted(reverse_kl) and all(-10 < v < 0 for v in teacher.values()), teacher
    assert metric_series(run, "ppo/pg_loss") == dict.fromkeys(range(1, ITERATIONS + 1), 0.0)
    start, trained = (load_file(d / "model.safetensors") for d in (tiny_model_dir, run / "actor"))
    assert start.keys() == trained.keys() and all(torch.equal(trained[k], v) for k, v in start.items())
    png = (run / "report" / "distill.png").read_bytes()
    assert png.startswith(b"\x89PNG") and 'src="report/distill.png"' in (run / "report.html").read_text()
    assert "distill/jsd" not in read_records(str(run / "metrics.jsonl"))[1]  # reverse_kl: no JSD in the loss
    assert "held-out reward" in result.stdout

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "actor")
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step00000002"
    config_data = json.loads(config.read_text())
    config_data["logging"]["output_dir"] = str(resumed)
    (tmp_path / "resume.json").write_text(json.dumps(config_data))
    assert "resumed at iteration 2" in launch("train_ppo.py", tmp_path / "resume.json", "--resume").stdout
    for key in ("distill/teacher_logprob", "distill/reverse_kl", "ppo/response_length", "ppo/entropy"):
        assert_repeats(metric_series(resumed, key), metric_series(run, key), range(3, ITERATIONS + 1), key)
    assert_repeats(metric_series(resumed, "eval/distill/reverse_kl"), held_out)


def test_gkd_with_lmbda_below_1_trains_on_dataset_responses_on_the_iterations_drawn(tiny_model_dir, rm_data, tmp_path):
    """GKD with lmbda 0.5 (seed 0 draws iterations 1 and 3 from the dataset, 2 sampled), the student
    as its own teacher, no reward: a dataset iteration's samples are the prompt file's responses,
    each prompt's 4 alike and finished, nothing generated, no policy gradient (pg_loss 0) and no
    sampler gap; the sampled iteration generates; at the start the JSD and the reverse KL to the
    teacher are 0 up to rounding (the teacher is the actor; the update's forward packs otherwise)."""
    data = with_responses(rm_data, tmp_path / "data")
    config = distill_config(
        tmp_path / "ppo.json", tiny_model_dir, tiny_model_dir, data, tmp_path / "run", distill__mode="gkd",
        distill__lmbda=0.5, train__iterations=3, train__eval_every=0, checkpoint__every_steps=0,
    )  # fmt: skip
    launch("train_ppo.py", config)
    rows = {r["step"]: r for r in read_records(str(tmp_path / "run" / "metrics.jsonl")) if "ppo/finished" in r}
    assert {i: r["distill/on_policy"] for i, r in rows.items()} == {1: 0.0, 2: 1.0, 3: 0.0}
    for i in (1, 3):
        r = rows[i]
        assert r["ppo/finished"] == 1.0 and r["ppo/distinct_within_prompt"] == 0.25, r  # 4 copies of one response
        assert r["ppo/pg_loss"] == 0.0 and r["timing/generated_tokens_per_s"] == 0.0, r
        assert "ppo/sampler_logprob_gap" not in r and r["ppo/response_length"] < 24, r
    assert rows[2]["timing/generated_tokens_per_s"] > 0 and "ppo/sampler_logprob_gap" in rows[2]
    assert rows[2]["ppo/finished"] < 1 and rows[2]["ppo/distinct_within_prompt"] > 0.25
    assert abs(rows[1]["distill/jsd"]) < 1e-6 and abs(rows[1]["distill/reverse_kl"]) < 1e-6


def test_teacher_top_k_and_the_gkd_term_equal_naive_whole_sequence_forwards(
    process_group, tiny_model_dir, tied_tiny_model_dir
):
    """Four sequences packed two micro-batches at a time (shared prompts among them): the teacher's
    log-probs, top-k log-probs and ids per response token, and the actor's log-probs of those ids in
    the update's forward, with their JSD term in the loss, equal each sequence's own forward."""
    teacher, student = load_causal_lm(str(tied_tiny_model_dir)).eval(), load_causal_lm(str(tiny_model_dir)).eval()
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(4, student.config.vocab_size, (n,), generator=g).tolist()
    shared = ids(5)
    prompts, responses = [shared, shared, ids(3), ids(8)], [ids(n) for n in (6, 2, 7, 4)]
    sequences, prompt_lens = [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts]
    T, t, k, vocab = 7, 0.7, 5, student.config.vocab_size - 10  # the teacher ranks the first vocab ids only
    settings = DistillSettings("gkd", coef=2.0, beta=0.3, top_k=k, vocab=vocab)
    got = teacher_logprobs(
        teacher, sequences, prompt_lens, settings, T, max_tokens=24, pad_token_id=0, share_prompts=True, temperature=t
    )
    assert got.top_logprobs is not None and got.top_ids is not None
    assert got.top_ids.shape == (4, T, k) and got.top_ids.max() < vocab

    def naive(model, i):  # (R, V) the tempered log-distribution at each response position of sequence i
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sequences[i]]), use_cache=False).logits[0].float()
        return torch.log_softmax(logits / t, -1)[prompt_lens[i] - 1 : -1]

    for i, r in enumerate(responses):
        want = naive(teacher, i)
        top = want[:, :vocab].topk(k, dim=-1)
        torch.testing.assert_close(
            got.logprobs[i, : len(r)], want.gather(-1, torch.tensor(r)[:, None])[:, 0], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(got.top_logprobs[i, : len(r)], top.values, atol=1e-5, rtol=0)
        assert torch.equal(got.top_ids[i, : len(r)], top.indices) and got.logprobs[i, len(r) :].eq(0).all()

    mask = pad_right([torch.ones(len(r), dtype=torch.bool) for r in responses], T)
    zeros = torch.zeros(4, T)
    mb = Experience(
        sequences, prompt_lens, mask, zeros, zeros, zeros, zeros, zeros, torch.zeros(4), zeros, mask.float(), zeros, got
    )
    policy = PolicyLossSettings(clip_low=0.2, clip_high=0.2, clip_ratio_c=None, kl_loss_coef=0.0, kl_estimator="k3",
                                entropy_coef=0.0, distill=settings)  # fmt: skip
    update = UpdateSettings(policy, torch.ones(1), 0.2, 1, 4, 24, 0, 0, share_prompts=False, temperature=t)
    packed = pack_sequences(sequences, pad_token_id=0)
    with torch.no_grad():
        logprobs, _, student_top = actor_forward(student, packed, mb, update)
        loss = actor_token_loss(logprobs, zeros, mb, policy, student_top)
    assert student_top is not None and loss.jsd is not None
    for i, r in enumerate(responses):
        torch.testing.assert_close(
            student_top[i, : len(r)], naive(student, i).gather(-1, got.top_ids[i, : len(r)]), atol=1e-5, rtol=0
        )
    jsd = top_k_jsd(student_top, got.top_logprobs, 0.3, mask)
    assert (jsd[mask] > 0).all() and torch.equal(loss.jsd, jsd)
    assert isinstance(loss.pg, PolicyLoss) and torch.allclose(loss.per_token, loss.pg.loss + 2.0 * jsd)


def test_reverse_kl_mode_adds_each_tokens_advantage_to_the_estimators(
    process_group, tiny_model_dir, tied_tiny_model_dir
):
    """make_experience with a reverse_kl teacher: the GRPO advantages of the same rollout plus
    -coef x (log pi_old - log pi_teacher) at each sampled token, and the rollout's distill/* means."""
    teacher, student = load_causal_lm(str(tied_tiny_model_dir)).eval(), load_causal_lm(str(tiny_model_dir)).eval()
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(4, student.config.vocab_size, (n,), generator=g).tolist()
    prompts = [ids(4), ids(6)]
    samples = [Sample(p, ids(n), [0.0] * n, finished=True) for p in prompts for n in (3, 5)]  # 2 prompts x 2
    rollout = Rollout(samples, [Prompt([], {})] * 4, torch.tensor([1.0, 0.0, 0.5, 0.5]), {})
    engines = HybridEngine(student, None, student, None, None, None, teacher)
    settings = ExperienceSettings(
        max_tokens=64, value_readout=ValueReadout(torch.ones(1)), kl_estimator="k1", gae=GaeSettings(1.0, 1.0, False),
        advantage_estimator="grpo", group_size=2, temperature=0.7,
    )  # fmt: skip
    distill = DistillSettings("reverse_kl", coef=0.5, beta=0.5, top_k=4, vocab=student.config.vocab_size)
    make = lambda s: make_experience(rollout, engines, 0, s, kl_coef=0.0, old_logprobs_from_sampler=False)
    (plain, plain_stats), (taught, stats) = make(settings), make(replace(settings, distill=distill))
    assert plain.teacher is None and taught.teacher is not None and taught.teacher.top_ids is None
    extra = reverse_kl_advantages(taught.old_logprobs, taught.teacher.logprobs, taught.mask, 0.5)
    assert extra[taught.mask].abs().min() > 0  # the teacher is another model: every token's term counts
    torch.testing.assert_close(taught.advantages, plain.advantages + extra, atol=1e-6, rtol=0)
    mask = taught.mask
    log_ratio = (taught.old_logprobs - taught.teacher.logprobs)[mask]
    assert stats["distill/reverse_kl"] == pytest.approx(log_ratio.mean().item(), rel=1e-5)
    assert stats["distill/teacher_logprob"] == pytest.approx(taught.teacher.logprobs[mask].mean().item(), rel=1e-5)
    assert not any(k.startswith("distill/") for k in plain_stats)
