"""The chunked LM head (engine/data/lm_head.py) equals the whole-matrix computation: log-probs,
entropy and the gradients of both, with tied and untied embeddings, bare and with LoRA adapters, at
a sampling temperature."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.data import lm_head
from engine.data.packing import pack_sequences, packed_forward
from engine.models.lora import add_adapters
from engine.run_config import LoraSection


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attn_implementation="sdpa_varlen",
    )
    return LlamaForCausalLM(config).float()


def whole_matrix(model, packed, positions, targets, temperature: float = 1.0):
    """Today's computation before chunking: the (K, V) logits / temperature, their log-softmax and entropy."""
    logp = torch.log_softmax(packed_forward(model, packed, logits_positions=positions)[0].float() / temperature, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("tied, lora", [(True, False), (False, False), (True, True)])
def test_chunked_head_equals_the_whole_matrix_with_gradients(tied, lora, monkeypatch):
    model = tiny_llama(tied)
    if lora:
        model = add_adapters(model, LoraSection(rank=4, alpha=8.0), causal_lm=True)
        for name, p in model.named_parameters():  # B = 0 at start: move the adapters off the identity
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 14, 5)]
    packed = pack_sequences(sequences, pad_token_id=0)
    positions = torch.cat([torch.arange(s, s + n - 1) for s, n in zip(packed.starts, packed.seq_lens)])  # (K,)
    targets = packed.input_ids[0, positions + 1]
    weights = torch.randn(len(positions), 2, generator=g)
    monkeypatch.setattr(lm_head, "HEAD_CHUNK", 5)  # K = 25: five chunks, the last one short

    def gradients(compute, entropy_grad):
        model.zero_grad()
        logp, entropy = compute(entropy_grad)
        loss = (weights[:, 0] * logp).sum() + (weights[:, 1] * (entropy if entropy_grad else entropy.detach())).sum()
        loss.backward()
        trained = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return logp.detach(), entropy.detach(), trained

    for entropy_grad, t in ((True, 0.6), (True, 1.0), (False, 1.0)):  # t: a rollout's sampling temperature
        chunked = gradients(
            lambda grad: lm_head.token_logprobs(model, packed, positions, targets, True, grad, temperature=t),  # noqa: B023
            entropy_grad,
        )
        whole = gradients(lambda _: whole_matrix(model, packed, positions, targets, t), entropy_grad)  # noqa: B023
        torch.testing.assert_close(chunked[0], whole[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(chunked[1], whole[1], atol=1e-6, rtol=1e-6)  # entropy ~ log 300
        assert chunked[2].keys() == whole[2].keys() and (lora or "lm_head.weight" in chunked[2] or tied)
        for name in whole[2]:
            scale = whole[2][name].abs().max().item()
            assert scale > 0, name
            torch.testing.assert_close(chunked[2][name], whole[2][name], atol=1e-6 * max(scale, 1.0), rtol=0)

    with torch.no_grad():  # no gradient: no recomputation, the same values; log-probs alone
        logp, entropy = lm_head.token_logprobs(model, packed, positions, targets)
    assert entropy is None and torch.equal(logp, chunked[0])


def test_teacher_top_k_and_student_log_probs_of_those_tokens_equal_the_whole_matrix():
    """Distillation's two head passes (engine/data/lm_head.py): a frozen teacher's top-k log-probs
    and ids among the student's vocabulary, and the student's differentiable log-probs of those ids,
    computed in chunks, equal the whole matrix's at a sampling temperature."""
    teacher, student = tiny_llama(tied=False), tiny_llama(tied=True)
    g = torch.Generator().manual_seed(2)
    packed = pack_sequences([torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 14, 5)], pad_token_id=0)
    positions = torch.cat([torch.arange(s, s + n - 1) for s, n in zip(packed.starts, packed.seq_lens)])  # (K,)
    targets, t, k, vocab = packed.input_ids[0, positions + 1], 0.7, 6, 250  # the top-k among the first 250 ids
    with torch.no_grad():
        head, hidden = lm_head.head_inputs(teacher, packed, positions)
        logprobs, top, ids = lm_head.head_top_k(head, hidden, targets, k, vocab, chunk=5, temperature=t)
        whole = torch.log_softmax(packed_forward(teacher, packed, logits_positions=positions)[0] / t, -1)  # (K, V)
    expected = whole[:, :vocab].topk(k, dim=-1)
    torch.testing.assert_close(top, expected.values, atol=1e-6, rtol=0)
    assert torch.equal(ids, expected.indices) and ids.max() < vocab
    torch.testing.assert_close(logprobs, whole.gather(-1, targets[:, None]).squeeze(-1), atol=1e-6, rtol=0)

    weights = torch.randn(len(positions), k, generator=g)

    def gradient(compute):
        student.zero_grad()
        values = compute()
        (weights * values).sum().backward()
        return values.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}

    chunked = gradient(
        lambda: lm_head.head_logprobs_at(*lm_head.head_inputs(student, packed, positions), ids, chunk=5, temperature=t)
    )
    logits = lambda: packed_forward(student, packed, logits_positions=positions)[0]  # (K, V)
    naive = gradient(lambda: torch.log_softmax(logits() / t, -1).gather(-1, ids))
    torch.testing.assert_close(chunked[0], naive[0], atol=1e-6, rtol=0)
    for name, grad in naive[1].items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(chunked[1][name], grad, atol=1e-6 * max(scale, 1.0), rtol=0, msg=name)
