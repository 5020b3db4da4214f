"""Prompt files of PPO: the ``prompt`` column (message lists) of ``prompts_*.parquet`` (written by
data_prep/prepare_prompts.py or prepare_preferences.py) with the columns the rewards read, and the
prompts that fit the context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerBase

from engine.data.chat import prompt_ids
from engine.data.errors import DataFileError, read_parquet

Messages = list[dict[str, str]]
MADE_BY = "data_prep/prepare_prompts.py (or prepare_preferences.py: prompts_*.parquet)"


class Prompt(NamedTuple):
    """A prompt and its row's other columns that the rewards read (e.g. a reference answer)."""

    messages: Messages
    fields: dict[str, Any]


def load_prompts(path: str, fields: dict[str, str] | None = None) -> list[Prompt]:
    """The prompts of ``path`` with their ``fields`` columns (column -> the config key that reads it);
    :class:`DataFileError` when a column is missing or a row's value is null."""
    fields = fields or {}
    table = read_parquet(path, ("prompt", *fields), MADE_BY, readers=fields)
    if not table.num_rows:
        raise DataFileError(f"{path}: no prompts")
    columns = {f: table.column(f).to_pylist() for f in fields}
    for f, values in columns.items():
        if None in values:
            raise DataFileError(f"{path}[row {values.index(None)}]: column '{f}' is null; {fields[f]} reads it")
    return [
        Prompt(messages, {f: columns[f][i] for f in fields})
        for i, messages in enumerate(table.column("prompt").to_pylist())
    ]


def prompts_that_fit(
    prompts: Sequence[Prompt], tokenizer: PreTrainedTokenizerBase, max_tokens: int
) -> tuple[list[Prompt], int]:
    """The prompts whose rendered tokens number at most ``max_tokens`` (room is left for the
    response), and how many were dropped."""
    kept = [p for p in prompts if len(prompt_ids(tokenizer, p.messages)) <= max_tokens]
    return kept, len(prompts) - len(kept)
