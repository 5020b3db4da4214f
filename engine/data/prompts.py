"""Prompt files of PPO: the ``prompt`` column (message lists) of data_prep/prepare_preferences.py's
``prompts_*.parquet``, and the prompts that fit the context."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from engine.data.chat import prompt_ids
from engine.data.errors import DataFileError, read_parquet

Messages = list[dict[str, str]]


def load_prompts(path: str) -> list[Messages]:
    prompts = (
        read_parquet(path, ("prompt",), "data_prep/prepare_preferences.py (prompts_*.parquet)")
        .column("prompt")
        .to_pylist()
    )
    if not prompts:
        raise DataFileError(f"{path}: no prompts")
    return prompts


def prompts_that_fit(
    prompts: Sequence[Messages], tokenizer: PreTrainedTokenizerBase, max_tokens: int
) -> tuple[list[Messages], int]:
    """The prompts whose rendered tokens number at most ``max_tokens`` (room is left for the
    response), and how many were dropped."""
    kept = [p for p in prompts if len(prompt_ids(tokenizer, p)) <= max_tokens]
    return kept, len(prompts) - len(kept)
