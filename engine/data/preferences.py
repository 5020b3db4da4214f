"""Tokenized preference pairs from the parquet files of data_prep/prepare_preferences.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from engine.data.chat import TemplateMismatch, check_closings, tokenize_pairs
from engine.data.errors import DataFileError, read_parquet
from engine.data.packing import PackedBatch, pack_sequences, pack_shared

REQUIRED_COLUMNS = ("prompt", "chosen", "rejected", "margin", "components")


@dataclass(frozen=True)
class PreferenceExample:
    """One pair as token ids: prompt + chosen, prompt + rejected (each a full conversation)."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float  # 0.0 where the data gives none
    labels: tuple[int, ...]  # per configured component: +1 chosen better, -1 rejected better, 0 unlabelled
    shared_prefix: int = 0  # leading tokens packed once for both (engine/data/packing.pack_shared); 0: none shared
    prompt_len: int = 0  # leading tokens of both that are the prompt: the responses start there (DPO's log-probs)

    @property
    def num_tokens(self) -> int:
        """Tokens the pair takes in a packed row: its shared prefix counts once."""
        return len(self.chosen_ids) + len(self.rejected_ids) - self.shared_prefix


def shared_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common start of ``a`` and ``b``, leaving each at least one token of its own."""
    limit, n = min(len(a), len(b)) - 1, 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def load_preferences(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    components: Sequence[str],
    use_margin: bool,
    share_prompt: bool = False,
    chunk: int = 1024,
) -> list[PreferenceExample]:
    """Read and tokenize a pairs parquet; labels follow the order of ``components``. With
    ``share_prompt`` each pair's common first tokens (its prompt) are marked to pack once."""
    rows = read_parquet(path, REQUIRED_COLUMNS, "data_prep/prepare_preferences.py").to_pylist()
    if not rows:
        raise DataFileError(f"{path}: no pairs")
    examples = []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        prompts = [r["prompt"] for r in part] * 2
        try:
            prompt_ids, full = tokenize_pairs(
                tokenizer, prompts, [r["chosen"] for r in part] + [r["rejected"] for r in part]
            )
            check_closings(tokenizer, full)
        except TemplateMismatch as e:
            raise DataFileError(f"{path}: row {start + e.index % len(part)}: {e}") from None
        for i, r in enumerate(part):
            labels = dict(r["components"] or [])
            examples.append(
                PreferenceExample(
                    chosen_ids=full[i],
                    rejected_ids=full[len(part) + i],
                    margin=float(r["margin"]) if use_margin and r["margin"] is not None else 0.0,
                    labels=tuple(int(labels.get(name, 0)) for name in components),
                    shared_prefix=shared_prefix_length(full[i], full[len(part) + i]) if share_prompt else 0,
                    prompt_len=len(prompt_ids[i]),
                )
            )
    if len(components) > 1:
        for c, name in enumerate(components):
            if not any(e.labels[c] for e in examples):
                raise DataFileError(
                    f"{path}: component '{name}' is configured (rm.components) but no pair carries its label; "
                    f"the labels here: {labelled_components(rows)}"
                )
    return examples


def collate_pairs(examples: Sequence[PreferenceExample]) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
    """One packed row of the pairs (c0, r0, c1, r1, ...; a pair's shared prefix once, before its
    two continuations), margins (B,), labels (B, C)."""
    if any(e.shared_prefix for e in examples):
        packed = pack_shared(
            [
                (e.chosen_ids[: e.shared_prefix], [e.chosen_ids[e.shared_prefix :], e.rejected_ids[e.shared_prefix :]])
                for e in examples
            ]
        )
    else:
        packed = pack_sequences([ids for e in examples for ids in (e.chosen_ids, e.rejected_ids)])
    margins = torch.tensor([e.margin for e in examples], dtype=torch.float32)
    labels = torch.tensor([e.labels for e in examples], dtype=torch.long)  # (B, C); C = 0: unlabelled (DPO)
    return packed, margins, labels


def labelled_components(rows: Sequence[dict]) -> list[str]:
    """The component names the rows of a pairs file carry labels for."""
    return sorted({name for r in rows for name, label in (r["components"] or []) if label})


def pairs_that_fit(examples: Sequence[PreferenceExample], max_tokens: int) -> tuple[list[PreferenceExample], int]:
    """The pairs whose chosen + rejected tokens (packed together) fit ``max_tokens``, and how many were dropped."""
    kept = [e for e in examples if e.num_tokens <= max_tokens]
    return kept, len(examples) - len(kept)


def load_fitting_pairs(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    components: Sequence[str],
    use_margin: bool,
    share_prompt: bool,
    max_tokens: int,
    rank: int,
) -> list[PreferenceExample]:
    """The pairs of ``path`` (:func:`load_preferences`) that fit one micro-batch of ``max_tokens``
    (train.max_tokens_per_micro_batch); those that do not are dropped and counted (rank 0 prints it)."""
    pairs, dropped = pairs_that_fit(load_preferences(path, tokenizer, components, use_margin, share_prompt), max_tokens)
    if not pairs:
        raise DataFileError(f"{path}: no pair fits train.max_tokens_per_micro_batch ({max_tokens} tokens)")
    if dropped and rank == 0:
        print(
            f"{path}: dropped {dropped} of {len(pairs) + dropped} pairs longer than train.max_tokens_per_micro_batch "
            f"({max_tokens} tokens, chosen + rejected{', the prompt once' if share_prompt else ''})"
        )
    return pairs
