"""engine/dpo/losses.py against hand-computed values; engine/dpo/pairs.py against whole-sequence forwards."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from engine.data.preferences import load_preferences
from engine.dpo.losses import dpo_loss, ipo_loss, simpo_loss
from engine.dpo.pairs import pair_logprobs
from engine.models.loading import load_causal_lm

# One pair: the policy raised the chosen response's log-prob by 1 over the reference and lowered the
# rejected one's by 1, so h = 2.
POLICY_C, POLICY_R, REF_C, REF_R = (torch.tensor([v]) for v in (-5.0, -7.0, -6.0, -6.0))


def test_dpo_is_the_logistic_loss_of_beta_times_the_log_ratio_margin():
    out = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1)
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.2)))  # -log sigmoid(0.1 * 2)
    assert out.chosen_reward.item() == pytest.approx(0.1) and out.rejected_reward.item() == pytest.approx(-0.1)


def test_label_smoothing_mixes_in_the_flipped_label():
    out = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1, label_smoothing=0.1)
    assert out.loss.item() == pytest.approx(0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2)))


def test_dpo_gradient_raises_the_chosen_and_lowers_the_rejected_log_prob():
    chosen, rejected = POLICY_C.clone().requires_grad_(), POLICY_R.clone().requires_grad_()
    dpo_loss(chosen, rejected, REF_C, REF_R, beta=0.1).loss.sum().backward()
    sigma = 1 / (1 + math.exp(0.2))  # sigmoid(-beta h)
    assert chosen.grad.item() == pytest.approx(-0.1 * sigma) and rejected.grad.item() == pytest.approx(0.1 * sigma)


def test_ipo_regresses_the_margin_to_one_over_two_beta():
    assert ipo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1).loss.item() == pytest.approx((2 - 5) ** 2)
    assert ipo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.25).loss.item() == pytest.approx(0.0)


def test_simpo_uses_mean_log_probs_and_a_target_margin_without_a_reference():
    out = simpo_loss(torch.tensor([-0.5]), torch.tensor([-0.8]), beta=2.0, gamma=0.5)
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.1)))  # -log sigmoid(2 * 0.3 - 0.5)
    assert out.chosen_reward.item() == pytest.approx(-1.0) and out.rejected_reward.item() == pytest.approx(-1.6)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_pair_log_probs_and_the_dpo_loss_equal_whole_sequence_forwards(tiny_model_dir, rm_data, share_prompt):
    """Packed (with shared prompts or not) against one unpacked forward per response, fp32, 1e-5."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = load_preferences(str(rm_data / "validation.parquet"), tokenizer, ["helpful"], False, share_prompt)[:6]
    assert all(0 < e.prompt_len <= min(len(e.chosen_ids), len(e.rejected_ids)) - 1 for e in examples)
    assert not share_prompt or all(e.shared_prefix >= e.prompt_len for e in examples)
    model = load_causal_lm(str(tiny_model_dir)).eval()
    packed = pair_logprobs(model, examples)

    def whole(ids: list[int], p: int) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, p - 1 : -1].float()
        return logits.log_softmax(-1).gather(-1, torch.tensor(ids[p:])[:, None]).sum()

    with torch.no_grad():
        want_c = torch.stack([whole(e.chosen_ids, e.prompt_len) for e in examples])
        want_r = torch.stack([whole(e.rejected_ids, e.prompt_len) for e in examples])
    torch.testing.assert_close(packed.chosen.detach(), want_c, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.rejected.detach(), want_r, atol=1e-5, rtol=0)
    assert packed.chosen_tokens.tolist() == [len(e.chosen_ids) - e.prompt_len for e in examples]
    ref_c, ref_r = want_c - 0.3, want_r + 0.2  # a reference a little behind on both
    got, want = (
        dpo_loss(c, r, ref_c, ref_r, beta=0.1).loss for c, r in ((packed.chosen, packed.rejected), (want_c, want_r))
    )
    torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=0)
