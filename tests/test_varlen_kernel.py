"""The CUDA varlen path (engine/data/varlen_kernel.py) on the CPU: its query/key boundaries and
gathered keys, fed to a reference of the kernel call, give what the per-sequence SDPA path gives,
for plain and shared-prompt rows with a long segment, values and gradients. (The kernel itself
runs on a lent GPU: tests/gpu/varlen_attention.py.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.data import packing
from engine.data.packing import pack_sequences, pack_shared, packed_forward
from engine.data.varlen_kernel import varlen_kernel, varlen_layout
from engine.models.loading import load_causal_lm


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """What a varlen flash call computes: (T_q, H, D) queries over (T_k, H_kv, D) keys, each query
    sequence over its key sequence, causal aligned bottom-right (query i of Lq sees keys <= Lk - Lq + i)."""
    out = []
    for (qs, qe), (ks, ke) in zip(
        zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(), cu_k[1:].tolist())
    ):
        assert qe - qs <= max_q and ke - ks <= max_k
        lq, lk = qe - qs, ke - ks
        visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        o = F.scaled_dot_product_attention(
            *(t.transpose(0, 1)[None] for t in (q[qs:qe], k[ks:ke], v[ks:ke])),
            attn_mask=visible,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def test_layout_of_plain_and_shared_prompt_rows():
    plain = varlen_layout((0, 3, 8), ((), ()))
    assert plain.cu_seq_q.tolist() == plain.cu_seq_k.tolist() == [0, 3, 8] and plain.key_rows.tolist() == list(range(8))
    # a sequence of 2, then a prompt of 3 with branches of 2 and 1: the prompt, then each branch over prompt + itself
    shared = varlen_layout((0, 2, 8), ((2,), (2, 1)))
    assert shared.cu_seq_q.tolist() == [0, 2, 5, 7, 8]
    assert shared.cu_seq_k.tolist() == [0, 2, 5, 10, 14]
    assert shared.key_rows.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 2, 3, 4, 7]
    assert (shared.max_q, shared.max_k) == (3, 5)
    assert varlen_kernel(torch.device("cpu"), torch.bfloat16) is None  # the kernels are CUDA-only


def test_the_kernel_path_equals_the_sdpa_path_with_shared_prompts(tiny_model_dir, monkeypatch):
    model = load_causal_lm(str(tiny_model_dir), attn_implementation="sdpa_varlen")
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist()
    rows = {
        "plain": pack_sequences([ids(n) for n in (7, 150, 3, 40)]),
        # a short tree-masked segment, a long one (> SHORT_BLOCK_TOKENS: per-branch calls), a plain sequence
        "shared": pack_shared([(ids(5), [ids(4), ids(6)]), (ids(200), [ids(60), ids(30), ids(2)]), (ids(9), [ids(3)])]),
    }
    for name, packed in rows.items():
        results = []
        for kernel in (None, reference_varlen):
            monkeypatch.setattr(packing, "varlen_kernel", lambda device, dtype, kernel=kernel: kernel)
            model.zero_grad()
            logits = packed_forward(model, packed)
            (logits.square().mean()).backward()
            results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
        (sdpa, sdpa_grads), (varlen, varlen_grads) = results
        torch.testing.assert_close(varlen, sdpa, atol=1e-5, rtol=1e-5, msg=name)
        for a, b in zip(varlen_grads, sdpa_grads):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4, msg=name)
