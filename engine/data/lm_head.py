"""Log-probs (and entropy) of chosen tokens through the LM head in chunks of positions, so that no
(K, V) logits tensor of a whole micro-batch is ever alive.

At K = 8,192 predicted tokens and Qwen2.5's V = 151,936 the fp32 logits alone are 5 GB, and their
softmax, its product with the log-probs and the backward each as much again. Here the model runs
with its head on no position (its final hidden states (K, H) are kept), then the head runs on
``HEAD_CHUNK`` positions at a time: log p(target) = z[target] - logsumexp(z) and the entropy
logsumexp(z) - sum softmax(z) * z in float32. With gradients each chunk is recomputed in the
backward (activation checkpointing, the non-reentrant kind), so forward and backward hold one
chunk's logits at a time; the head's weight gets its gradient from every chunk (tied embeddings
included). Liger-Kernel's fused linear cross-entropy and verl's fused PPO head do the same with
custom kernels; this is the torch-only form, exact against the whole-matrix computation.
"""

from __future__ import annotations

from typing import cast

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from engine.data.packing import PackedBatch, packed_forward

HEAD_CHUNK = 1024  # positions per head call: (1024, 151,936) fp32 logits are 0.6 GB
# Config attributes of architectures whose logits are not the head's output as is (Gemma 2/3's
# softcapping, Cohere's and Granite's scaling): they take the whole-matrix path.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _chunk_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    entropy_grad: bool,
    temperature: float,
) -> torch.Tensor:
    """(C, H) hidden states, (C,) token ids -> (C, 1) log p(target), or (C, 2) with the entropy, of
    softmax(logits / temperature)."""
    logits = head(hidden).float() / temperature  # (C, V)
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs[:, None]
    z, lse_z = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
    entropy = lse_z - (torch.softmax(z, dim=-1) * z).sum(-1)
    return torch.stack([logprobs, entropy], dim=-1)


def head_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk: int = HEAD_CHUNK,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(K, H) final hidden states and (K,) target ids -> (K,) log p(target) and (K,) entropy (or
    None) of the distribution sampled at ``temperature`` (softmax of the logits / temperature),
    float32 on the hidden states' device, ``chunk`` positions at a time. Differentiable in
    ``hidden`` and the head's weights; the entropy is detached unless ``entropy_grad``."""
    targets = targets.to(hidden.device)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    parts = []
    for h, t in zip(hidden.split(chunk), targets.split(chunk)):
        if recompute:
            parts.append(
                checkpoint(_chunk_logprobs, head, h, t, with_entropy, entropy_grad, temperature, use_reentrant=False)
            )
        else:
            parts.append(_chunk_logprobs(head, h, t, with_entropy, entropy_grad, temperature))
    stats = torch.cat(parts) if parts else hidden.new_zeros(0, 2 if with_entropy else 1, dtype=torch.float32)
    if not with_entropy:
        return stats[:, 0], None
    return stats[:, 0], stats[:, 1] if entropy_grad else stats[:, 1].detach()


def head_inputs(model, packed: PackedBatch, positions: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor]:
    """A causal LM (bare, PEFT-wrapped or in a DeepSpeed engine) on a packed row: its LM head and the
    head's (K, H) inputs at row ``positions`` (the model runs with its head on no position). An
    architecture whose logits are not the head's output as is: the identity and the (K, V) logits."""
    hf_model = cast(PreTrainedModel, getattr(model, "module", model))
    if any(getattr(hf_model.config, name, None) for name in LOGIT_TRANSFORMS):
        return torch.nn.Identity(), packed_forward(model, packed, logits_positions=positions)[0]  # (K, V)
    head = hf_model.get_output_embeddings()
    kept: list[torch.Tensor] = []

    def keep_hidden_states(_module, args):  # the head runs on no position; its input is kept
        kept.append(args[0])
        return (args[0][:, :0],)

    hook = head.register_forward_pre_hook(keep_hidden_states)
    try:
        packed_forward(model, packed, logits_positions=positions)
    finally:
        hook.remove()
    return head, kept[0][0]


def token_logprobs(
    model,
    packed: PackedBatch,
    positions: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A causal LM on a packed row (:func:`head_inputs`): (K,) log p of ``targets`` predicted at row
    ``positions`` and (K,) the entropy there (or None), float32 on the model's device, the head run in
    chunks (:func:`head_logprobs`), of the distribution sampled at ``temperature``."""
    head, hidden = head_inputs(model, packed, positions)
    return head_logprobs(head, hidden, targets, with_entropy, entropy_grad, HEAD_CHUNK, temperature=temperature)


def _chunk_logprobs_at(
    head: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """(C, H) hidden states, (C, k) token ids -> (C, k) their log-probs under softmax(logits / temperature)."""
    logits = head(hidden).float() / temperature  # (C, V)
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


def head_logprobs_at(
    head: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, chunk: int = HEAD_CHUNK, *, temperature: float = 1.0
) -> torch.Tensor:
    """(K, H) final hidden states and (K, k) token ids -> (K, k) float32 log-probs of those tokens at
    each position, ``chunk`` positions at a time (recomputed in the backward, as :func:`head_logprobs`);
    differentiable in ``hidden`` and the head's weights."""
    ids = ids.to(hidden.device)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    parts = [
        checkpoint(_chunk_logprobs_at, head, h, i, temperature, use_reentrant=False)
        if recompute
        else _chunk_logprobs_at(head, h, i, temperature)
        for h, i in zip(hidden.split(chunk), ids.split(chunk))
    ]
    return torch.cat(parts) if parts else hidden.new_zeros(0, ids.shape[1], dtype=torch.float32)


@torch.no_grad()
def head_top_k(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    vocab: int,
    chunk: int = HEAD_CHUNK,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, H) final hidden states, (K,) target ids -> (K,) log p(target), and the (K, k) log-probs and
    ids of the k likeliest tokens among the first ``vocab`` at each position (a teacher whose embedding
    matrix is padded past the student's vocabulary ranks only tokens the student has), float32,
    ``chunk`` positions at a time, of softmax(logits / temperature). No gradient: a frozen model's."""
    targets = targets.to(hidden.device)
    logprobs, top_logprobs, top_ids = [], [], []
    for h, t in zip(hidden.split(chunk), targets.split(chunk)):
        logits = head(h).float() / temperature  # (C, V)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # as _chunk_logprobs: a student = teacher agrees to the bit
        logprobs.append((logits.gather(-1, t[:, None]) - lse).squeeze(-1))
        top = logits[:, :vocab].topk(min(k, vocab), dim=-1)
        top_logprobs.append(top.values - lse)
        top_ids.append(top.indices)
    if not logprobs:
        empty = hidden.new_zeros(0, min(k, vocab), dtype=torch.float32)
        return hidden.new_zeros(0, dtype=torch.float32), empty, empty.long()
    return torch.cat(logprobs), torch.cat(top_logprobs), torch.cat(top_ids)
