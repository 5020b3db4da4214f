"""engine/models/lora.py and the merged weights the LoRA sync sends (engine/models/hf_weights.py) on a
real PEFT model: the merged weights are the adapted model's, the disabled adapters are the base."""

from __future__ import annotations

import pytest
import torch

from engine.data.packing import pack_sequences, packed_forward
from engine.models.hf_weights import hf_weight_buckets
from engine.models.loading import load_causal_lm, load_value_model
from engine.models.lora import adapters_disabled, add_adapters
from engine.run_config import LoraSection

PACKED = pack_sequences([[5, 6, 7, 8, 9, 10], [11, 12, 13]])


@pytest.fixture(scope="module")
def adapted(tiny_model_dir):
    """(base model, the same with trained-looking adapters: B drawn at random, not zero)."""
    torch.manual_seed(0)
    model = add_adapters(load_causal_lm(str(tiny_model_dir)), LoraSection(rank=4, dropout=0.5), causal_lm=True)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return load_causal_lm(str(tiny_model_dir)), model


def test_only_the_adapters_train(adapted):
    _, model = adapted
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * 7 * model.config.num_hidden_layers  # A and B on every projection of every layer


def test_disabled_adapters_are_the_base_model_exactly_even_with_dropout(adapted):
    base, model = adapted
    model.train()  # LoRA dropout active: the adapted output is random, the disabled one is not
    with torch.no_grad(), adapters_disabled(model):
        reference = packed_forward(model, PACKED)
    model.eval()
    assert torch.equal(reference, packed_forward(base, PACKED).detach())
    assert not torch.allclose(packed_forward(model, PACKED), reference, atol=1e-3)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # restored after the context


def test_synced_weights_are_the_merged_model_under_the_base_names(adapted, tiny_model_dir):
    base, model = adapted
    model.eval()
    merged = {name: t.clone() for bucket in hf_weight_buckets(model) for name, t in bucket}
    assert merged.keys() == dict(base.named_parameters()).keys()  # what vLLM knows: no base_layer, no lora_ names
    fresh = load_causal_lm(str(tiny_model_dir))
    fresh.load_state_dict(merged)
    with torch.no_grad():
        assert torch.allclose(packed_forward(fresh, PACKED), packed_forward(model, PACKED), atol=1e-5)
        with adapters_disabled(model):
            base_weights = {name: t.clone() for bucket in hf_weight_buckets(model) for name, t in bucket}
    assert all(torch.equal(base_weights[n], p) for n, p in base.named_parameters())


def test_a_critic_trains_its_adapters_and_its_whole_value_head(tiny_model_dir):
    critic = add_adapters(load_value_model(str(tiny_model_dir), ["value"]), LoraSection(rank=4), causal_lm=False)
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {n for n in trained if "lora_" not in n} == {"base_model.model.score.weight", "base_model.model.score.bias"}
