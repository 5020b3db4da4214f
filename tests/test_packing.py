"""Packed forwards equal padded forwards; packed, dynamically batched gradients equal padded ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import sdpa_mask

from engine.data import packing
from engine.data.batching import plan_micro_batches, token_mean_scale
from engine.data.packing import (
    attention_calls,
    block_causal_mask,
    last_token,
    next_token_logprobs,
    pack_sequences,
    packed_forward,
)
from engine.data.response_tokens import response_logprobs
from engine.models.loading import load_causal_lm, load_value_model, resolve_attention

LENGTHS = [7, 1, 23, 12, 2, 30, 9]
ATTENTION = ["sdpa_varlen", "sdpa", "eager"]


def make_sequences(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def pad_right(sequences, pad_id=0):
    """(B, L) ids and (B, L) mask, True where the token counts."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
    return ids, mask


def padded_logprobs(model, sequences):
    ids, mask = pad_right(sequences)
    logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, L-1)
    return [lp[i, : len(s) - 1] for i, s in enumerate(sequences)]


@pytest.fixture(scope="module", params=ATTENTION)
def causal_lm(request, tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir), attn_implementation=request.param).eval()


@pytest.fixture(scope="module", params=ATTENTION)
def value_model(request, tiny_model_dir):
    torch.manual_seed(0)
    return load_value_model(str(tiny_model_dir), ["helpful", "harmless"], attn_implementation=request.param).eval()


def test_packed_logprobs_equal_padded(causal_lm):
    seqs = make_sequences(LENGTHS, causal_lm.config.vocab_size)
    packed = pack_sequences(seqs)
    with torch.no_grad():
        got = next_token_logprobs(packed_forward(causal_lm, packed), packed)
        want = padded_logprobs(causal_lm, seqs)
    assert [g.shape[0] for g in got] == [n - 1 for n in LENGTHS]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_sdpa_varlen_builds_no_mask_in_packed_calls_and_sdpas_elsewhere(tiny_model_dir, monkeypatch):
    """Inside packed_forward attention runs per sequence and transformers' (T, T) mask is not
    built; a padded batch outside it still gets sdpa's mask (and the same log-probs)."""
    built = []
    monkeypatch.setattr(packing, "sdpa_mask", lambda **kw: built.append(kw["q_length"]) or sdpa_mask(**kw))
    model = load_causal_lm(str(tiny_model_dir), attn_implementation="sdpa_varlen").eval()
    seqs = make_sequences(LENGTHS, model.config.vocab_size)
    packed = pack_sequences(seqs)
    with torch.no_grad():
        got = next_token_logprobs(packed_forward(model, packed), packed)
        assert built == []
        want = padded_logprobs(model, seqs)
    assert built == [max(LENGTHS)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_response_logprobs_and_entropy(tiny_model_dir):
    """Response-only LM head = the padded full log-probs on the response; the entropy joins the
    graph only when asked (an entropy bonus), otherwise it is a detached metric."""
    model = load_causal_lm(str(tiny_model_dir))
    seqs, prompt_lens = make_sequences(LENGTHS[2:], model.config.vocab_size), [5, 1, 1, 3, 4]
    packed = pack_sequences(seqs)
    logprobs, entropy = response_logprobs(model, packed, prompt_lens, with_entropy=True)
    with torch.no_grad():
        want = padded_logprobs(model, seqs)
    for got, w, p in zip(logprobs, want, prompt_lens):
        torch.testing.assert_close(got, w[p - 1 :], atol=1e-5, rtol=0)
    assert logprobs[0].requires_grad and not entropy[0].requires_grad
    assert all((e > 0).all() and (e <= torch.log(torch.tensor(model.config.vocab_size)) + 1e-4).all() for e in entropy)
    _, entropy = response_logprobs(model, packed, prompt_lens, with_entropy=True, entropy_grad=True)
    assert entropy[0].requires_grad


def test_packing_really_isolates_sequences(causal_lm):
    """Control: the same row with one ordinary causal mask gives different log-probs."""
    seqs = make_sequences([10, 10], causal_lm.config.vocab_size)
    packed = pack_sequences(seqs)
    with torch.no_grad():
        isolated = next_token_logprobs(packed_forward(causal_lm, packed), packed)[1]
        leaky = causal_lm(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=True).logits
        leaked = next_token_logprobs(leaky, packed)[1]
    assert (isolated - leaked).abs().max() > 1e-3


def test_explicit_mask_fallback_equals_position_id_packing(causal_lm, monkeypatch):
    """The explicit block-diagonal mask (the branch for attention implementations packing does not
    know) gives what each implementation's own packing gives."""
    seqs = make_sequences(LENGTHS, causal_lm.config.vocab_size)
    packed = pack_sequences(seqs)
    masks = []
    monkeypatch.setattr(
        "engine.data.packing.block_causal_mask", lambda *a: masks.append(block_causal_mask(*a)) or masks[-1]
    )
    with torch.no_grad():
        by_positions = packed_forward(causal_lm, packed)
        assert masks == []
        # Treat this implementation as unknown: sdpa_varlen then runs as plain sdpa with the mask.
        monkeypatch.setattr("engine.data.packing.POSITION_ID_PACKING", ())
        monkeypatch.setattr("engine.data.packing.VARLEN_SDPA", "not-this-one")
        by_mask = packed_forward(causal_lm, packed)
    assert len(masks) == 1 and masks[0].shape == (1, 1, sum(LENGTHS), sum(LENGTHS))
    torch.testing.assert_close(by_mask, by_positions, atol=1e-5, rtol=0)


def test_packed_values_and_rewards_equal_padded(value_model):
    seqs = make_sequences(LENGTHS, value_model.config.vocab_size, seed=1)
    packed = pack_sequences(seqs)
    ids, mask = pad_right(seqs)
    with torch.no_grad():
        per_token = packed_forward(value_model, packed)  # (1, T, 2)
        padded = value_model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits  # (B, L, 2)
    for i, (rows, n) in enumerate(zip(packing.sequence_rows(packed), LENGTHS)):
        v = per_token[0, rows]
        assert v.shape == (n, 2)
        torch.testing.assert_close(v, padded[i, :n], atol=1e-5, rtol=0)
    rewards = last_token(per_token, packed)  # (N, 2)
    want = torch.stack([padded[i, n - 1] for i, n in enumerate(LENGTHS)])
    torch.testing.assert_close(rewards, want, atol=1e-5, rtol=0)


def test_empty_micro_batch_is_a_one_token_dummy():
    packed = pack_sequences([], pad_token_id=3)
    assert packed.input_ids.tolist() == [[3]] and packed.seq_lens == [] and packed.num_tokens == 0
    assert packing.sequence_rows(packed) == []
    with pytest.raises(ValueError, match="empty sequence"):
        pack_sequences([[1], []])


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_dynamic_step_gradients_equal_padded_full_batch(tiny_model_dir):
    """Token-mean NLL over a mini-batch: padded one-shot vs packed micro-batches of <= 40 tokens."""
    model = load_causal_lm(str(tiny_model_dir))
    seqs = make_sequences(LENGTHS, model.config.vocab_size, seed=2)

    model.zero_grad()
    lp = padded_logprobs(model, seqs)
    (-torch.cat(lp).sum() / sum(n - 1 for n in LENGTHS)).backward()
    want = grads_of(model)

    model.zero_grad()
    plan = plan_micro_batches([len(s) for s in seqs], max_tokens=40)
    assert len(plan) > 2  # really several micro-batches
    scale = token_mean_scale(sum(n - 1 for n in LENGTHS), world_size=1)
    for micro in plan:
        packed = pack_sequences([seqs[i] for i in micro])
        lp = next_token_logprobs(packed_forward(model, packed), packed)
        (-torch.cat(lp).sum() * scale).backward()
    got = grads_of(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)


def test_reward_pairs_packed_together_give_padded_bt_gradients(tiny_model_dir):
    """Sequence-level loss: chosen/rejected of a pair stay adjacent in one micro-batch."""
    torch.manual_seed(0)
    model = load_value_model(str(tiny_model_dir))
    chosen = make_sequences([9, 14, 3, 20], model.config.vocab_size, seed=3)
    rejected = make_sequences([11, 4, 16, 8], model.config.vocab_size, seed=4)

    model.zero_grad()
    ids, mask = pad_right(chosen + rejected)
    scores = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits[..., 0]  # (2B, L)
    ends = mask.sum(1) - 1
    r = scores[torch.arange(len(ends)), ends]
    (-F.logsigmoid(r[:4] - r[4:]).mean()).backward()
    want = grads_of(model)

    model.zero_grad()
    pair_lengths = [len(c) + len(j) for c, j in zip(chosen, rejected)]
    plan = plan_micro_batches(pair_lengths, max_tokens=30)
    seen = []
    for micro in plan:
        packed = pack_sequences([s for i in micro for s in (chosen[i], rejected[i])])
        rewards = last_token(packed_forward(model, packed), packed)[:, 0].view(-1, 2)  # (pairs, [chosen, rejected])
        (-F.logsigmoid(rewards[:, 0] - rewards[:, 1]).sum() * token_mean_scale(4, 1)).backward()
        seen += micro
    assert sorted(seen) == [0, 1, 2, 3]
    for name, g in grads_of(model).items():
        torch.testing.assert_close(g, want[name], atol=1e-5, rtol=0, msg=name)


def test_value_model_components_are_named_and_checked(tiny_model_dir, tmp_path):
    model = load_value_model(str(tiny_model_dir), ["helpful", "harmless"])
    model.save_pretrained(tmp_path / "rm")
    again = load_value_model(str(tmp_path / "rm"), ["helpful", "harmless"])
    assert again.config.id2label == {0: "helpful", 1: "harmless"}
    torch.testing.assert_close(again.score.weight, model.score.weight)
    with pytest.raises(ValueError, match="components"):
        load_value_model(str(tmp_path / "rm"), ["reward"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choice")
def test_auto_attention_on_a_cpu_is_varlen_sdpa(tiny_model_dir):
    """``auto`` picks flash-attn only on a GPU with flash-attn and a 16-bit dtype."""
    assert resolve_attention("auto", torch.bfloat16) == "sdpa_varlen"  # no GPU here
    assert resolve_attention("eager", torch.float32) == "eager"
    assert load_causal_lm(str(tiny_model_dir)).config._attn_implementation == "sdpa_varlen"


def test_attention_calls_group_short_neighbours_and_leave_long_sequences_alone():
    bounds = [0, 7, 8, 31, 43, 45, 75, 84]  # LENGTHS
    assert attention_calls(bounds, 0, 256) == [(s, [n]) for s, n in zip(bounds, LENGTHS)]
    assert attention_calls(bounds, 24, 24) == [(0, [7, 1]), (8, [23]), (31, [12, 2]), (45, [30]), (75, [9])]
    assert attention_calls(bounds, 12, 256) == [(0, [7, 1]), (8, [23]), (31, [12, 2]), (45, [30]), (75, [9])]
    assert attention_calls(bounds, 256, 256) == [(0, LENGTHS)]


@pytest.mark.parametrize("short_tokens, block_tokens", [(0, 0), (24, 24), (256, 256)])
def test_sdpa_varlen_with_any_call_grouping_equals_padded_with_gradients(
    tiny_model_dir, short_tokens, block_tokens, monkeypatch
):
    """One call per sequence, short neighbours grouped under a block-diagonal mask, or the whole
    row in one call: the same log-probs and gradients as padded, unpacked sequences."""
    monkeypatch.setattr(packing, "SHORT_SEQUENCE_TOKENS", short_tokens)
    monkeypatch.setattr(packing, "SHORT_BLOCK_TOKENS", block_tokens)
    model = load_causal_lm(str(tiny_model_dir), attn_implementation="sdpa_varlen")
    seqs = make_sequences(LENGTHS, model.config.vocab_size, seed=3)
    model.zero_grad()
    want_lp = padded_logprobs(model, seqs)
    torch.cat(want_lp).sum().backward()
    want = grads_of(model)
    model.zero_grad()
    packed = pack_sequences(seqs)
    got_lp = next_token_logprobs(packed_forward(model, packed), packed)
    torch.cat(got_lp).sum().backward()
    for g, w in zip(got_lp, want_lp):
        torch.testing.assert_close(g, w.detach(), atol=1e-5, rtol=0)
    got = grads_of(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)


def test_tree_causal_lets_a_branch_see_its_prompt_and_itself_only():
    t, f = True, False
    assert packing.tree_causal(((2, (1, 2)),)).tolist() == [
        [t, f, f, f, f],  # prompt 0
        [t, t, f, f, f],  # prompt 1
        [t, t, t, f, f],  # branch a
        [t, t, f, t, f],  # branch b, first token: not branch a
        [t, t, f, t, t],
    ]
    assert packing.tree_causal(((1, ()), (1, (1,)))).tolist() == [[t, f, f], [f, t, f], [f, t, t]]  # segments apart
    assert torch.equal(packing.block_causal((2, 3)), packing.tree_causal(((2, ()), (3, ()))))


def test_long_shared_prompt_segments_run_a_call_per_branch(monkeypatch):
    """Past SHORT_BLOCK_TOKENS a segment runs as a prompt call plus one call per branch, with the
    output of the segment's tree mask."""
    original, calls = packing.branch_attention, []
    monkeypatch.setattr(packing, "branch_attention", lambda *a, **kw: calls.append(a[3:5]) or original(*a, **kw))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 305, 8) for _ in range(3))  # (1, H, T, D)
    bounds = torch.tensor(
        [0, 270, 305], dtype=torch.int32
    )  # 100 + 90 + 80: per-branch calls; 20 + 10 + 5: a masked call
    got, _ = packing.varlen_sdpa_attention(
        torch.nn.Module(), q, k, v, None, cu_seq_lens_q=bounds, packed_branches=((90, 80), (10, 5))
    )
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=packing.tree_causal(((100, (90, 80)), (20, (10, 5))))
    ).transpose(1, 2)
    assert calls == [(100, (90, 80))]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("short_tokens, block_tokens", [(0, 256), (0, 0), (256, 256)])
def test_shared_prompt_rows_give_the_rewards_and_gradients_of_separate_sequences(
    tiny_model_dir, short_tokens, block_tokens, monkeypatch
):
    """Pairs packed as prompt once + chosen + rejected (one call per pair with a tree mask, or a
    prompt call and one per branch, or all in one call) score and backpropagate like each
    conversation packed whole."""
    monkeypatch.setattr(packing, "SHORT_SEQUENCE_TOKENS", short_tokens)
    monkeypatch.setattr(packing, "SHORT_BLOCK_TOKENS", block_tokens)
    torch.manual_seed(0)
    model = load_value_model(str(tiny_model_dir), ["a", "b"])
    prompts = make_sequences([9, 3, 20], model.config.vocab_size, seed=5)
    chosen = make_sequences([4, 1, 7], model.config.vocab_size, seed=6)
    rejected = make_sequences([2, 6, 1], model.config.vocab_size, seed=7)
    shared = packing.pack_shared([(p, [c, r]) for p, c, r in zip(prompts, chosen, rejected)])
    assert shared.num_tokens == sum(map(len, prompts + chosen + rejected))
    assert shared.position_ids[0, 9:15].tolist() == [9, 10, 11, 12, 9, 10]  # both branches continue the prompt
    whole = pack_sequences([p + s for p, c, r in zip(prompts, chosen, rejected) for s in (c, r)])
    results = []
    for packed in (whole, shared):
        model.zero_grad()
        rewards = last_token(packed_forward(model, packed), packed)  # (6, 2): c0, r0, c1, r1, ...
        (rewards * torch.arange(1.0, 13.0).view(6, 2)).sum().backward()
        results.append((rewards.detach(), grads_of(model)))
    (want_r, want_g), (got_r, got_g) = results
    torch.testing.assert_close(got_r, want_r, atol=1e-5, rtol=0)
    for name in want_g:  # gradients up to ~70 here (the reward weights 1..12): relative 1e-5
        torch.testing.assert_close(got_g[name], want_g[name], atol=1e-5, rtol=1e-5, msg=name)
