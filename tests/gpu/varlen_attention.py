"""Our packed attention on CUDA against the CPU (run by tests/gpu/check.sh).

    python tests/gpu/varlen_attention.py

``sdpa_varlen`` (engine/data/packing.py) runs, on CUDA in bf16, one varlen flash call for the whole
packed row (engine/data/varlen_kernel.py: flash-attn's, else PyTorch's ``varlen_attn``), shared
prompts included; on the CPU one causal SDPA call per sequence. For one packed row of 32 sequences
(64-1,024 tokens), and for the same tokens as 8 shared-prompt segments of 4 branches, this prints
the largest output gap of the GPU path (and of a bare ``varlen_attn`` call, plain row) against the
CPU path in fp32, and the forward + backward time of each, and of the per-sequence loop on the GPU
(the path before the kernel). Exit status 1 when a gap is out of tolerance.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import time
from types import SimpleNamespace

import torch

from engine.data import packing
from engine.data.packing import varlen_sdpa_attention

HEADS, HEAD_DIM = 12, 64


def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, branches=None) -> torch.Tensor:
    """(T, H, D) in and out, through the packed path's attention function (``branches``: each
    segment's branch lengths, as engine.data.packing.pack_shared makes them)."""
    out, _ = varlen_sdpa_attention(
        SimpleNamespace(num_key_value_groups=1),
        *(x.transpose(0, 1)[None] for x in (q, k, v)),
        None,
        cu_seq_lens_q=cu,
        packed_branches=branches,
    )
    return out[0]


def loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, branches=None) -> torch.Tensor:
    """The per-sequence SDPA loop on whatever device (the kernel switched off)."""
    kernel, packing.varlen_kernel = packing.varlen_kernel, lambda device, dtype: None
    try:
        return ours(q, k, v, cu, branches)
    finally:
        packing.varlen_kernel = kernel


def torch_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal ``varlen_attn`` over (T, H, D) tensors (its causal argument differs between torch versions)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    cu = cu.to(q.device)
    longest = int((cu[1:] - cu[:-1]).max())
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, **causal)


def seconds(fn, *args, reps: int = 10) -> float:
    """Mean forward + backward time after three warm-ups."""
    for i in range(reps + 3):
        if i == 3:
            torch.cuda.synchronize()
            start = time.perf_counter()
        fn(*args).float().square().sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main() -> int:
    torch.manual_seed(0)
    lens = torch.randint(64, 1025, (32,))
    cu = torch.tensor([0, *lens.cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(int(cu[-1]), HEADS, HEAD_DIM) for _ in range(3))
    want = ours(q, k, v, cu)  # fp32, CPU
    status = 0
    print(
        f"torch {torch.__version__}, one packed row of {len(lens)} sequences, {int(cu[-1])} tokens, "
        f"{HEADS} heads x {HEAD_DIM}"
    )
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401

        has_varlen = True
    except ImportError as e:
        has_varlen = False
        print(f"torch.nn.attention.varlen: not in this torch ({e})")
    gpu = [x.cuda().bfloat16().requires_grad_() for x in (q, k, v)]
    # the same tokens as 8 segments: a prompt of the first sequence's length, then 3 branches of the next ones
    lengths = lens.tolist()
    segments = [(lengths[i], tuple(lengths[i + 1 : i + 4])) for i in range(0, 32, 4)]
    tree_cu = torch.tensor([0, *itertools.accumulate(p + sum(b) for p, b in segments)], dtype=torch.int32)
    tree_branches = tuple(b for _, b in segments)
    want_tree = ours(q, k, v, tree_cu, tree_branches)
    candidates = [
        ("sdpa_varlen on cuda (the varlen kernel)", ours, cu, None, want),
        ("sdpa_varlen on cuda, shared prompts", ours, tree_cu, tree_branches, want_tree),
        ("per-sequence SDPA loop on cuda (before)", loop, cu, None, want),
    ] + ([("bare torch varlen_attn", torch_varlen, cu, None, want)] if has_varlen else [])
    for name, fn, bounds, branches, expected in candidates:
        args = (*gpu, bounds) if branches is None else (*gpu, bounds, branches)
        try:
            got = fn(*args).float().cpu()
            gap = (got - expected).abs().max().item()
            ok = gap < 0.05  # bf16 against fp32
            status |= not ok
            print(
                f"{'PASS' if ok else 'FAIL'} {name}: bf16 cuda vs fp32 cpu max gap {gap:.2e}; "
                f"fwd+bwd {seconds(fn, *args) * 1e3:.2f} ms"
            )
        except Exception as e:
            status = 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    return status


if __name__ == "__main__":
    sys.exit(main())
