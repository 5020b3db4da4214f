"""engine/ppo/experience.py: make_experience on real models against a naive padded computation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from engine.ppo.experience import OldLogprobSource, make_experience
from engine.ppo.rewards import RewardScorer
from engine.rollout.sampler import Sample
from engine.runtime.models import load_causal_lm, load_value_model

PROMPT_LENS, RESPONSE_LENS = [6, 3, 9, 4], [5, 8, 2, 6]


@pytest.fixture(scope="module")
def models(tiny_model_dir, rm_run):
    root, _ = rm_run
    rm_dir = str(root / "run" / "model")
    torch.manual_seed(0)
    scorer = RewardScorer(load_value_model(rm_dir).eval(), AutoTokenizer.from_pretrained(rm_dir), rm_dir, normalize=True, clip=5.0,
                          rules={}, no_eos_penalty=0.0, max_tokens=512)
    actor = load_causal_lm(str(tiny_model_dir)).eval()
    return actor, load_value_model(str(tiny_model_dir), ["value"]).eval(), scorer, AutoTokenizer.from_pretrained(tiny_model_dir)


def samples(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [Sample(ids(p), ids(r), [0.0] * r, finished=True) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]


def test_make_experience_equals_naive_padded_forwards(process_group, models):
    actor, critic, scorer, tokenizer = models
    batch = samples(actor.config.vocab_size)
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(len(batch))]
    # ref = actor: the KL is zero, so each token's reward is 0 but the last (the score); gamma = lam = 1.
    exp, stats = make_experience(batch, prompt_messages=prompts, actor=actor, critic=critic, ref=actor, scorer=scorer,
                                 value_weights=torch.ones(1), tokenizer=tokenizer, max_tokens=24, kl_estimator="k1", kl_coef=0.5,
                                 gamma=1.0, lam=1.0, whiten_advantages=True)
    T = max(RESPONSE_LENS)
    assert exp.mask.shape == (4, T) and exp.mask.sum(1).tolist() == RESPONSE_LENS
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in batch]
    scores = scorer.score(prompts, texts, [True] * 4)[0]
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
    torch.testing.assert_close(exp.advantages[exp.mask], (raw - raw.mean()) / (raw.var(unbiased=False) + 1e-8).sqrt(), atol=1e-5, rtol=0)
    assert stats["kl"] == 0.0 and stats["score"] == pytest.approx(scores.mean().item())
    assert stats["response_length"] == sum(RESPONSE_LENS) / 4 and stats["finished"] == 1.0
    assert stats["sampler_logprob_gap"] > 0  # the samples carry made-up (zero) sampler log-probs


def test_old_logprobs_from_the_sampler_skip_the_actor_forward(process_group, models):
    actor, critic, scorer, tokenizer = models
    batch = samples(actor.config.vocab_size)
    batch = [Sample(s.prompt_ids, s.response_ids, [-0.5 - 0.1 * j for j in range(len(s.response_ids))], True) for s in batch]
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(len(batch))]
    exp, stats = make_experience(batch, prompt_messages=prompts, actor=None, critic=critic, ref=actor, scorer=scorer,
                                 value_weights=torch.ones(1), tokenizer=tokenizer, max_tokens=24, kl_estimator="k1", kl_coef=0.5,
                                 gamma=1.0, lam=1.0, whiten_advantages=True, old_logprobs_from_sampler=True)
    for i, s in enumerate(batch):  # no actor forward ran (actor=None): the sampler's log-probs, padded
        assert exp.old_logprobs[i, : len(s.logprobs)].tolist() == pytest.approx(s.logprobs)
    assert "sampler_logprob_gap" not in stats  # nothing to measure it against
    assert torch.equal(exp.is_weights, exp.mask.float()) and "tis_weight" not in stats  # no ppo.tis_cap


def test_truncated_importance_weights_compare_the_actor_with_the_sampler(process_group, models):
    actor, critic, scorer, tokenizer = models
    batch = [Sample(s.prompt_ids, s.response_ids, [-1.0] * len(s.response_ids), True) for s in samples(actor.config.vocab_size)]
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(len(batch))]
    exp, stats = make_experience(batch, prompt_messages=prompts, actor=actor, critic=None, ref=actor, scorer=scorer,
                                 value_weights=torch.ones(1), tokenizer=tokenizer, max_tokens=24, kl_estimator="k1", kl_coef=0.0,
                                 gamma=1.0, lam=1.0, whiten_advantages=False, advantage_estimator="reinforce_pp", tis_cap=1.5)
    want = (exp.old_logprobs + 1.0).exp().clamp(max=1.5) * exp.mask  # pi_actor / pi_sampler, the sampler's log-prob -1 each
    torch.testing.assert_close(exp.is_weights, want)
    assert stats["tis_weight"] == pytest.approx(want[exp.mask].mean().item(), abs=1e-6)
    assert stats["tis_truncated"] == pytest.approx((want[exp.mask] >= 1.5).float().mean().item())


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
