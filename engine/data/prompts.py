"""Prompt files of PPO: the ``prompt`` column (message lists) of data_prep/prepare_preferences.py's
``prompts_*.parquet``."""

from __future__ import annotations

import pyarrow.parquet as pq


def load_prompts(path: str) -> list[list[dict[str, str]]]:
    table = pq.read_table(path)
    if "prompt" not in table.column_names:
        raise ValueError(f"{path}: no 'prompt' column; use prepare_preferences.py's prompts_*.parquet")
    return table.column("prompt").to_pylist()
