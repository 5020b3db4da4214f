"""engine/ppo/experience.py and engine/ppo/forwards.py: make_experience on real models against a
naive padded computation; shared-prompt forwards against whole sequences."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from engine.data import packing
from engine.data.packing import packed_forward
from engine.data.prompts import Prompt
from engine.data.response_tokens import response_logprobs
from engine.models.loading import load_causal_lm, load_value_model
from engine.ppo.collect import Rollout
from engine.ppo.engines import HybridEngine
from engine.ppo.experience import OldLogprobSource, make_experience
from engine.ppo.forwards import ValueReadout, response_values
from engine.ppo.rewards import RewardModelScorer, RewardScorer, SampledResponses
from engine.ppo.rollout_correction import RolloutCorrection
from engine.ppo.settings import ExperienceSettings, GaeSettings
from engine.rollout.sampler import Sample
from engine.run.micro_batches import micro_batches
from engine.run_config.rewards import RewardModelSection, RewardsSection

PROMPT_LENS, RESPONSE_LENS = [6, 3, 9, 4], [5, 8, 2, 6]
# k1 KL, undiscounted GAE with lam = 1 (every return is the score), whitened; micro-batches of 24 tokens
SETTINGS = ExperienceSettings(
    max_tokens=24,
    value_readout=ValueReadout(torch.ones(1)),
    kl_estimator="k1",
    gae=GaeSettings(gamma=1.0, lam=1.0, whiten=True),
)


def engines(actor, critic, scorer) -> HybridEngine:
    """The models make_experience reads: the reference is the actor (the KL is zero)."""
    return HybridEngine(
        actor=actor, critic=critic, ref=actor, reward_model=scorer.reward_model.model, judge=None, keep_alive=None
    )


@pytest.fixture(scope="module")
def models(tiny_model_dir, rm_run):
    root, _ = rm_run
    rm_dir = str(root / "run" / "model")
    torch.manual_seed(0)
    reward_model = RewardModelScorer(
        load_value_model(rm_dir).eval(), AutoTokenizer.from_pretrained(rm_dir), RewardModelSection(path=rm_dir), 512
    )
    scorer = RewardScorer(reward_model, None, RewardsSection(clip=5.0))
    actor = load_causal_lm(str(tiny_model_dir)).eval()
    return (
        actor,
        load_value_model(str(tiny_model_dir), ["value"]).eval(),
        scorer,
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )


def samples(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()
    return [Sample(ids(p), ids(r), [0.0] * r, finished=True) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]


def scored(batch: list[Sample], prompts: list[Prompt], scorer, tokenizer) -> Rollout:
    return Rollout(batch, prompts, *scorer.score(SampledResponses.decode(prompts, batch, tokenizer)))


def grouped_samples(vocab: int) -> list[Sample]:
    """Three prompts with three samples each, contiguous as the sampler returns them."""
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()
    out = []
    for p, responses in zip((7, 3, 12), ((5, 1, 8), (2, 6, 3), (4, 9, 1))):
        prompt = ids(p)
        out += [Sample(prompt, ids(r), [-1.0] * r, finished=True) for r in responses]
    return out


def test_make_experience_equals_naive_padded_forwards(process_group, models):
    actor, critic, scorer, tokenizer = models
    batch = samples(actor.config.vocab_size)
    prompts = [Prompt([{"role": "user", "content": f"question {i}"}], {}) for i in range(len(batch))]
    # ref = actor: the KL is zero, so each token's reward is 0 but the last (the score); gamma = lam = 1.
    exp, stats = make_experience(
        scored(batch, prompts, scorer, tokenizer),
        engines(actor, critic, scorer),
        tokenizer.pad_token_id,
        SETTINGS,
        kl_coef=0.5,
        old_logprobs_from_sampler=False,
    )
    T = max(RESPONSE_LENS)
    assert exp.mask.shape == (4, T) and exp.mask.sum(1).tolist() == RESPONSE_LENS
    scores = scorer.score(SampledResponses.decode(prompts, batch, tokenizer))[0]
    torch.testing.assert_close(exp.scores, scores)
    for i, s in enumerate(batch):
        seq, p, r = torch.tensor([s.prompt_ids + s.response_ids]), len(s.prompt_ids), len(s.response_ids)
        with torch.no_grad():
            logits = actor(input_ids=seq, use_cache=False).logits[0].float()  # (L, V)
            values = critic(input_ids=seq, use_cache=False).logits[0, :, 0]  # (L,)
        want_logprobs = logits.log_softmax(-1)[p - 1 : -1].gather(-1, seq[0, p:, None]).squeeze(-1)
        torch.testing.assert_close(exp.old_logprobs[i, :r], want_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(exp.old_values[i, :r], values[p - 1 : -1], atol=1e-5, rtol=0)
        assert exp.old_logprobs[i, r:].eq(0).all() and exp.old_values[i, r:].eq(0).all()
        torch.testing.assert_close(exp.returns[i, :r], scores[i].expand(r))  # undiscounted: every return is the score
    assert exp.kl.eq(0).all() and torch.equal(exp.ref_logprobs, exp.old_logprobs)
    raw = (exp.returns - exp.old_values)[exp.mask]  # GAE with lam = 1: return - value, then whitened over the batch
    torch.testing.assert_close(
        exp.advantages[exp.mask], (raw - raw.mean()) / (raw.var(unbiased=False) + 1e-8).sqrt(), atol=1e-5, rtol=0
    )
    assert stats["kl"] == 0.0 and stats["score"] == pytest.approx(scores.mean().item())
    assert stats["response_length"] == sum(RESPONSE_LENS) / 4 and stats["finished"] == 1.0
    # The samples carry made-up (zero) sampler log-probs: the gap is the actor's log-probs; samples that waited
    # from an earlier iteration (dynamic sampling) are not the last sync's, and count in no gap.
    assert stats["sampler_gap_sum"] == pytest.approx(-exp.old_logprobs[exp.mask].sum().item(), rel=1e-5)
    assert stats["sampler_gap_tokens"] == sum(RESPONSE_LENS)
    rollout = replace(scored(batch, prompts, scorer, tokenizer), earlier=2)
    _, fresh = make_experience(
        rollout,
        engines(actor, critic, scorer),
        tokenizer.pad_token_id,
        SETTINGS,
        kl_coef=0.5,
        old_logprobs_from_sampler=False,
    )
    assert fresh["sampler_gap_sum"] == pytest.approx(-exp.old_logprobs[2:][exp.mask[2:]].sum().item(), rel=1e-5)
    assert fresh["sampler_gap_tokens"] == sum(RESPONSE_LENS[2:])


def test_truncated_responses_can_be_masked_out_of_the_loss(process_group, models):
    """DAPO's overlong filtering (ppo.mask_truncated): a response cut at max_new_tokens keeps its
    score and its place in the advantages, and counts in no loss (its row of the mask is empty)."""
    actor, critic, scorer, tokenizer = models
    batch = [replace(s, finished=i % 2 == 0) for i, s in enumerate(samples(actor.config.vocab_size))]
    prompts = [Prompt([{"role": "user", "content": f"question {i}"}], {}) for i in range(len(batch))]
    run = lambda **changes: make_experience(
        scored(batch, prompts, scorer, tokenizer),
        engines(actor, critic, scorer),
        tokenizer.pad_token_id,
        replace(SETTINGS, **changes),
        kl_coef=0.5,
        old_logprobs_from_sampler=False,
    )
    (kept, kept_stats), (masked, masked_stats) = run(), run(mask_truncated=True)
    assert masked.mask.sum(1).tolist() == [RESPONSE_LENS[0], 0, RESPONSE_LENS[2], 0]
    assert kept.mask.sum(1).tolist() == RESPONSE_LENS
    assert torch.equal(masked.scores, kept.scores) and torch.equal(masked.advantages, kept.advantages)
    assert masked_stats == kept_stats and masked_stats["finished"] == 0.5


def test_old_logprobs_from_the_sampler_skip_the_actor_forward(process_group, models):
    actor, critic, scorer, tokenizer = models
    batch = samples(actor.config.vocab_size)
    batch = [
        Sample(s.prompt_ids, s.response_ids, [-0.5 - 0.1 * j for j in range(len(s.response_ids))], True) for s in batch
    ]
    prompts = [Prompt([{"role": "user", "content": f"question {i}"}], {}) for i in range(len(batch))]
    no_actor = engines(actor, critic, scorer)._replace(actor=None)
    exp, stats = make_experience(
        scored(batch, prompts, scorer, tokenizer),
        no_actor,
        tokenizer.pad_token_id,
        SETTINGS,
        kl_coef=0.5,
        old_logprobs_from_sampler=True,
    )
    for i, s in enumerate(batch):  # no actor forward ran (actor=None): the sampler's log-probs, padded
        assert exp.old_logprobs[i, : len(s.logprobs)].tolist() == pytest.approx(s.logprobs)
    assert "sampler_gap_sum" not in stats  # nothing to measure it against
    assert torch.equal(exp.is_weights, exp.mask.float()) and "is_weight" not in stats  # no ppo.rollout_correction


def test_importance_weights_compare_the_actor_with_the_sampler(process_group, models):
    """ppo.rollout_correction: token ratios truncated; then a sequence mask that drops exactly the
    samples whose sampler log-probs are shifted (0.5 per token: a ratio e^(0.5 x length) > 2)."""
    actor, _critic, scorer, tokenizer = models
    batch = [
        Sample(s.prompt_ids, s.response_ids, [-1.0] * len(s.response_ids), True)
        for s in samples(actor.config.vocab_size)
    ]
    prompts = [Prompt([{"role": "user", "content": f"question {i}"}], {}) for i in range(len(batch))]
    settings = replace(
        SETTINGS,
        gae=GaeSettings(gamma=1.0, lam=1.0, whiten=False),
        advantage_estimator="reinforce_pp",
        rollout_correction=RolloutCorrection("token", "truncate", 1 / 1.5, 1.5),
    )
    exp, stats = make_experience(
        scored(batch, prompts, scorer, tokenizer),
        engines(actor, None, scorer),
        tokenizer.pad_token_id,
        settings,
        kl_coef=0.0,
        old_logprobs_from_sampler=False,
    )
    want = (exp.old_logprobs + 1.0).exp().clamp(
        max=1.5
    ) * exp.mask  # pi_actor / pi_sampler, the sampler's log-prob -1 each
    torch.testing.assert_close(exp.is_weights, want)
    assert stats["is_weight"] == pytest.approx(want[exp.mask].mean().item(), abs=1e-6)
    assert stats["is_truncated_share"] == pytest.approx((want[exp.mask] >= 1.5).float().mean().item())

    shifted = [False, True, False, True]  # responses of 8 and 6 tokens of 21
    batch = [
        replace(s, logprobs=(exp.old_logprobs[i, : len(s.response_ids)] - 0.5 * shifted[i]).tolist())
        for i, s in enumerate(batch)
    ]
    masked, masked_stats = make_experience(
        scored(batch, prompts, scorer, tokenizer),
        engines(actor, None, scorer),
        tokenizer.pad_token_id,
        replace(settings, rollout_correction=RolloutCorrection("sequence", "mask", 0.5, 2.0)),
        kl_coef=0.0,
        old_logprobs_from_sampler=False,
    )
    weights = masked.is_weights[exp.mask].split(RESPONSE_LENS)
    assert [bool(w.eq(0).all()) for w in weights] == shifted
    assert all(torch.allclose(w, torch.ones_like(w), atol=1e-5) for w, off in zip(weights, shifted) if not off)
    assert masked_stats["is_masked_share"] == pytest.approx(14 / 21)


def test_old_logprob_source_checks_itself_and_turns_off_for_good():
    source = OldLogprobSource("sampler", check_every=3, tolerance=1e-4)
    assert [source.use_sampler(i) for i in range(7)] == [False, True, True, False, True, True, False]
    assert source.observe(2e-7) is None and source.observe(None) is None
    assert "above ppo.sampler_logprob_tolerance" in source.observe(3e-3)
    assert not any(source.use_sampler(i) for i in range(7)) and source.observe(1.0) is None
    restored = OldLogprobSource("sampler", 3, 1e-4)
    restored.load_state_dict(source.state_dict())
    assert not restored.use_sampler(1)
    assert not any(OldLogprobSource("actor", 3, 1e-4).use_sampler(i) for i in range(7))


def test_shared_prompts_give_the_experience_of_whole_sequences(process_group, models, monkeypatch):
    """Every forward of make_experience (actor, reference, critic, reward model) with each prompt
    computed once for its samples equals the one over whole sequences."""
    actor, critic, scorer, tokenizer = models
    batch = grouped_samples(actor.config.vocab_size)
    prompts = [Prompt([{"role": "user", "content": f"question {i // 3}"}], {}) for i in range(len(batch))]
    results = []
    for share in (False, True):
        monkeypatch.setattr(scorer.reward_model, "share_prompts", share)
        settings = replace(
            SETTINGS,
            gae=GaeSettings(gamma=1.0, lam=0.95, whiten=True),
            share_prompts=share,
            rollout_correction=RolloutCorrection("token", "truncate", 0.5, 2.0),
        )
        results.append(
            make_experience(
                scored(batch, prompts, scorer, tokenizer),
                engines(actor, critic, scorer),
                tokenizer.pad_token_id,
                settings,
                kl_coef=0.1,
                old_logprobs_from_sampler=False,
            )[0]
        )
    whole, shared = results
    for field in ("old_logprobs", "ref_logprobs", "old_values", "scores", "advantages", "returns", "is_weights"):
        torch.testing.assert_close(getattr(shared, field), getattr(whole, field), atol=1e-5, rtol=0, msg=field)


@pytest.mark.parametrize("per_branch_calls", [False, True])
def test_shared_prompts_give_the_log_probs_values_and_gradients_of_whole_sequences(
    process_group, tiny_model_dir, per_branch_calls, monkeypatch
):
    """Training forwards: the prompt once per micro-batch (its group split where over the budget)
    gives each response's log-probs, entropy and values, and the gradients, of whole sequences;
    with short groups sharing masked attention calls, or a prompt call and one per response."""
    if per_branch_calls:
        for knob in ("SHORT_SEQUENCE_TOKENS", "SHORT_BLOCK_TOKENS"):  # every segment: calls per branch
            monkeypatch.setattr(packing, knob, 0)
    torch.manual_seed(0)
    models = {"actor": load_causal_lm(str(tiny_model_dir)), "critic": load_value_model(str(tiny_model_dir), ["a", "b"])}
    batch = grouped_samples(models["actor"].config.vocab_size)
    sequences, prompt_lens = [s.prompt_ids + s.response_ids for s in batch], [len(s.prompt_ids) for s in batch]
    weights = torch.rand(len(batch), 9, generator=torch.Generator().manual_seed(2))  # (B, max R) per-token loss weights
    results, tokens = [], []
    for share in (False, True):
        got, n = {}, 0
        for model in models.values():
            model.zero_grad()
        for indices, packed in micro_batches(
            models["actor"], sequences, prompt_lens, max_tokens=24, pad_token_id=0, share_prompts=share
        ):
            n += packed.num_tokens
            lens = [prompt_lens[i] for i in indices]
            logprobs, entropy = response_logprobs(models["actor"], packed, lens, with_entropy=True, entropy_grad=True)
            values = response_values(
                packed_forward(models["critic"], packed), packed, lens, ValueReadout(torch.tensor([1.0, -0.5]))
            )
            loss = 0.0
            for i, lp, h, v in zip(indices, logprobs, entropy, values):
                got[i] = (lp.detach(), h.detach(), v.detach())
                loss = loss + (weights[i, : len(lp)] * (lp + 0.1 * h + v**2)).sum()
            loss.backward()
        grads = {
            f"{m}.{n}": p.grad.clone()
            for m, model in models.items()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        results.append((got, grads))
        tokens.append(n)
    (want, want_g), (have, have_g) = results
    assert tokens == [
        105,
        73,
    ]  # each prompt once per micro-batch (the 12-token one twice: its group split), not once per sample
    for i, s in enumerate(batch):
        for w, h in zip(want[i], have[i]):
            assert len(h) == len(s.response_ids)
            torch.testing.assert_close(h, w, atol=1e-5, rtol=0)
    assert want_g.keys() == have_g.keys()
    for name in want_g:
        torch.testing.assert_close(have_g[name], want_g[name], atol=1e-5, rtol=1e-5, msg=name)
