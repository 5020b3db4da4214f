"""engine/rm/reward_model.py: pair scoring and evaluation against naive per-sequence forwards."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from engine.data.preferences import load_preferences
from engine.models.loading import load_value_model
from engine.rm.reward_model import evaluate_pairs, score_pairs

COMPONENTS, WEIGHTS = ["helpful", "harmless"], torch.tensor([0.7, 0.3])


@pytest.fixture(scope="module", params=[False, True], ids=["whole", "shared_prompt"])
def pairs_and_model(tiny_model_dir, rm_data, request):
    """Pairs packed whole, or with chosen and rejected sharing their prompt's tokens (rm.share_prompt)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = load_preferences(
        str(rm_data / "validation.parquet"), tokenizer, COMPONENTS, use_margin=False, share_prompt=request.param
    )[:24]
    torch.manual_seed(0)
    return examples, load_value_model(str(tiny_model_dir), COMPONENTS).eval(), tokenizer.pad_token_id


def naive_rewards(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].double()  # (C,)


def test_score_pairs_reads_the_last_token_of_each_sequence(pairs_and_model):
    examples, model, _ = pairs_and_model
    with torch.no_grad():
        r_chosen, r_rejected = score_pairs(model, examples[:5])
    for i, e in enumerate(examples[:5]):
        torch.testing.assert_close(r_chosen[i].double(), naive_rewards(model, e.chosen_ids), atol=1e-5, rtol=0)
        torch.testing.assert_close(r_rejected[i].double(), naive_rewards(model, e.rejected_ids), atol=1e-5, rtol=0)


def test_evaluate_pairs_in_micro_batches_equals_the_naive_statistics(process_group, pairs_and_model):
    examples, model, pad = pairs_and_model
    metrics = evaluate_pairs(
        model, examples, COMPONENTS, WEIGHTS, max_tokens=160, pad_token_id=pad
    )  # several micro-batches
    r_c = torch.stack([naive_rewards(model, e.chosen_ids) for e in examples])  # (B, C)
    r_r = torch.stack([naive_rewards(model, e.rejected_ids) for e in examples])
    total_c, total_r = r_c @ WEIGHTS.double(), r_r @ WEIGHTS.double()
    both = torch.cat([total_c, total_r])
    assert metrics["acc"] == pytest.approx((total_c > total_r).double().mean().item())
    assert metrics["margin"] == pytest.approx((total_c - total_r).mean().item(), abs=1e-5)
    assert metrics["loss_total"] == pytest.approx(-F.logsigmoid(total_c - total_r).mean().item(), abs=1e-5)
    assert metrics["reward_mean"] == pytest.approx(both.mean().item(), abs=1e-5)
    assert metrics["reward_std"] == pytest.approx(both.std(unbiased=False).item(), abs=1e-5)
    labels = torch.tensor([e.labels for e in examples], dtype=torch.float64)  # (B, C)
    for c, name in enumerate(COMPONENTS):
        labelled = labels[:, c] != 0
        oriented = ((r_c - r_r)[:, c] * labels[:, c])[labelled]
        assert metrics[f"acc_{name}"] == pytest.approx((oriented > 0).double().mean().item())
        assert metrics[f"loss_{name}"] == pytest.approx(-F.logsigmoid(oriented).mean().item(), abs=1e-5)
    assert 0 < metrics["acc"] < 1 and math.isfinite(
        metrics["loss_total"]
    )  # an untrained head: neither all right nor all wrong


def test_a_shared_prompt_is_the_common_start_of_chosen_and_rejected(tiny_model_dir, rm_data):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    whole, shared = (
        load_preferences(str(rm_data / "validation.parquet"), tokenizer, COMPONENTS, use_margin=False, share_prompt=s)
        for s in (False, True)
    )
    assert all(e.shared_prefix == 0 for e in whole)
    for w, e in zip(whole, shared):
        p = e.shared_prefix
        assert p > 0 and e.chosen_ids[:p] == e.rejected_ids[:p] and e.chosen_ids[p] != e.rejected_ids[p]
        assert e.num_tokens == w.num_tokens - p  # what token-budget batching counts
    assert sum(e.num_tokens for e in shared) < 0.7 * sum(
        e.num_tokens for e in whole
    )  # the synthetic prompts are ~24 of ~35 tokens
