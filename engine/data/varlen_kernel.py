"""One varlen flash-attention call for a packed row on CUDA, shared prompts included.

A varlen kernel takes query and key boundaries (``cu_seq_q``, ``cu_seq_k``) and applies the causal
mask bottom-right aligned: a query sequence of length Lq over a key sequence of length Lk sees, at
its i-th query, the keys up to Lk - Lq + i. So a packed row becomes one kernel call:

* a plain sequence is its own query and key sequence;
* a shared-prompt segment (engine/data/packing.py) is its prompt (queries and keys: causal), then
  one query sequence per branch whose keys are the prompt's and the branch's own, gathered into
  place (``key_rows``): each branch computes what it would alone, the prompt once.

The kernel is flash-attn's ``flash_attn_varlen_func`` where flash-attn is installed, else PyTorch's
own ``torch.nn.attention.varlen.varlen_attn`` (PyTorch >= 2.10); both need CUDA and 16-bit
tensors. Everything but the kernel call (:func:`varlen_layout`) is exact on the CPU, where
tests/test_varlen_kernel.py feeds it to a reference of the call.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Kernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class VarlenLayout:
    """A packed row as query and key sequences of one varlen call."""

    cu_seq_q: torch.Tensor  # (N + 1,) int32: query boundaries (the row's own order)
    cu_seq_k: torch.Tensor  # (N + 1,) int32: key boundaries in the gathered keys
    key_rows: torch.Tensor  # (T_k,) long: the row position of each gathered key
    max_q: int
    max_k: int


@functools.lru_cache(maxsize=8)
def varlen_layout(
    bounds: tuple[int, ...], branches: tuple[tuple[int, ...], ...], device: torch.device | None = None
) -> VarlenLayout:
    """Query/key boundaries and gathered key rows of a packed row (``bounds``: cumulative sequence
    boundaries; ``branches``: each segment's branch lengths, () or one branch for a plain one), on
    ``device`` (default the CPU). Cached: every layer of a forward (and its recomputation) asks
    for the same row's layout."""
    q_bounds, k_bounds, key_rows = [0], [0], list[int]()
    for (start, end), segment in zip(itertools.pairwise(bounds), branches):
        parts: list[tuple[range, list[int]]]  # (query rows, key rows) of each query sequence
        if len(segment) <= 1:
            parts = [(range(start, end), list(range(start, end)))]
        else:
            prompt = range(start, end - sum(segment))
            branch_starts = itertools.accumulate(segment[:-1], initial=prompt.stop)
            parts = [(prompt, list(prompt))]
            parts += [(range(s, s + n), [*prompt, *range(s, s + n)]) for s, n in zip(branch_starts, segment)]
        for queries, keys in parts:
            q_bounds.append(q_bounds[-1] + len(queries))
            k_bounds.append(k_bounds[-1] + len(keys))
            key_rows += keys
    q_lens, k_lens = (torch.tensor(b).diff() for b in (q_bounds, k_bounds))
    return VarlenLayout(
        torch.tensor(q_bounds, dtype=torch.int32, device=device),
        torch.tensor(k_bounds, dtype=torch.int32, device=device),
        torch.tensor(key_rows, dtype=torch.long, device=device),
        int(q_lens.max()),
        int(k_lens.max()),
    )


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> Kernel | None:
    """flash-attn's varlen call, else PyTorch's, on a CUDA device in 16 bits; None elsewhere."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]  # CUDA installs only

        def flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)

        return flash
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None

    accepts = inspect.signature(varlen_attn).parameters  # torch 2.11's has no enable_gqa
    causal: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in accepts else {"is_causal": True}

    def torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        options = dict(causal)
        if k.shape[1] != q.shape[1] and "enable_gqa" in accepts:
            options["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:  # grouped-query heads repeated to the query's
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **options)

    return torch_varlen


def kernel_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: VarlenLayout, scale, kernel: Kernel
) -> torch.Tensor:
    """(1, H, T, D) query and (1, H_kv, T, D) keys and values of a packed row -> (1, T, H, D), one
    ``kernel`` call over ``layout`` (on the query's device)."""
    q = query[0].transpose(0, 1).contiguous()  # (T, H, D)
    k, v = (t[0].transpose(0, 1).index_select(0, layout.key_rows) for t in (key, value))  # (T_k, H_kv, D)
    return kernel(q, k, v, layout.cu_seq_q, layout.cu_seq_k, layout.max_q, layout.max_k, scale)[None]
