"""Convert preference data (HH-RLHF or generic rows) into parquet splits for training.

    python -m data_prep.prepare_preferences --input pairs.jsonl [--input more.parquet ...] \\
        --tokenizer path/to/model --out data/ [--validation-fraction 0.05] [--seed 0]

Writes ``train.parquet`` and ``validation.parquet`` (pairs), ``prompts_train.parquet`` and
``prompts_validation.parquet`` (unique prompts, for PPO), and ``summary.json``. The split is
by prompt, so no prompt appears in both splits, and deterministic by seed. A split without rows
is not written: ``--validation-fraction 1`` prepares a validation-only file (e.g. a separate
held-out set), ``0`` a train-only one. Prints a table of
rows read / kept / dropped by reason and token-length percentiles.

A malformed row stops the run with ``file:line: field 'x': ...``; ``--skip-invalid`` skips
such rows and counts them by reason instead. Identical or empty responses, HH rows whose two
dialogues diverge before the last turn, and rows over the length limits are always dropped
and counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from data_prep.columns import AS_GIVEN, ColumnMap
from data_prep.preference_rows import PreferencePair, parse_preference_row
from data_prep.sources import DataError
from data_prep.splits import (
    MESSAGES,
    Tally,
    add_input_arguments,
    format_report,
    load_tokenizer,
    none_kept,
    parse_input_arguments,
    percentiles,
    read_rows,
    split_by_prompt,
    write_atomically,
    write_summary,
)
from engine.data.chat import TemplateMismatch, check_closings, tokenize_pairs

PAIR_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("prompt", MESSAGES),
        ("chosen", pa.string()),
        ("rejected", pa.string()),
        ("margin", pa.float64()),
        ("components", pa.map_(pa.string(), pa.int8())),
        ("prompt_tokens", pa.int32()),
        ("chosen_tokens", pa.int32()),
        ("rejected_tokens", pa.int32()),
    ]
)
PROMPT_SCHEMA = pa.schema([("source", pa.string()), ("prompt", MESSAGES), ("prompt_tokens", pa.int32())])


@dataclass(frozen=True)
class Row:
    """A parsed pair with where it came from and its token lengths (responses exclude the prompt)."""

    source: str
    pair: PreferencePair
    prompt_tokens: int
    chosen_tokens: int
    rejected_tokens: int


def read_pairs(
    inputs: Sequence[str],
    split: str,
    skip_invalid: bool,
    tally: Tally,
    columns: ColumnMap = AS_GIVEN,
    config_name: str | None = None,
) -> list[tuple[str, PreferencePair]]:
    """Parse every input row (its columns mapped first); malformed rows raise DataError unless ``skip_invalid``."""
    return read_rows(inputs, split, skip_invalid, tally, parse_preference_row, columns, config_name)


def measure_and_filter(
    pairs: list[tuple[str, PreferencePair]],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    max_length: int,
    tally: Tally,
    chunk: int = 512,
) -> list[Row]:
    """Token lengths through the chat template; rows over the limits are dropped and counted."""
    rows = []
    for start in range(0, len(pairs), chunk):
        part = pairs[start : start + chunk]
        prompts = [p.prompt for _, p in part] * 2
        responses = [p.chosen for _, p in part] + [p.rejected for _, p in part]
        n = len(part)
        try:
            prompt_ids, full_ids = tokenize_pairs(tokenizer, prompts, responses)
            check_closings(tokenizer, full_ids)
        except TemplateMismatch as e:
            raise DataError(f"{part[e.index % n][0]}: {e}") from None
        for i, (location, pair) in enumerate(part):
            prompt_len = len(prompt_ids[i])
            chosen_len, rejected_len = len(full_ids[i]) - prompt_len, len(full_ids[n + i]) - prompt_len
            if prompt_len > max_prompt_length:
                tally.dropped["prompt_too_long"] += 1
            elif prompt_len + max(chosen_len, rejected_len) > max_length:
                tally.dropped["too_long"] += 1
            else:
                rows.append(Row(location, pair, prompt_len, chosen_len, rejected_len))
    return rows


def write_pairs(rows: list[Row], path: str) -> None:
    table = pa.Table.from_pylist(
        [
            {
                "source": r.source,
                "prompt": r.pair.prompt,
                "chosen": r.pair.chosen,
                "rejected": r.pair.rejected,
                "margin": r.pair.margin,
                "components": list(r.pair.components.items()),
                "prompt_tokens": r.prompt_tokens,
                "chosen_tokens": r.chosen_tokens,
                "rejected_tokens": r.rejected_tokens,
            }
            for r in rows
        ],
        schema=PAIR_SCHEMA,
    )
    write_atomically(table, path)


def write_prompts(rows: list[Row], path: str) -> int:
    """Unique prompts (first occurrence kept) for PPO rollouts; returns how many."""
    seen: set[str] = set()
    records = []
    for r in rows:
        key = json.dumps(r.pair.prompt, sort_keys=True)
        if key not in seen:
            seen.add(key)
            records.append({"source": r.source, "prompt": r.pair.prompt, "prompt_tokens": r.prompt_tokens})
    write_atomically(pa.Table.from_pylist(records, schema=PROMPT_SCHEMA), path)
    return len(records)


def length_percentiles(rows: list[Row]) -> dict[str, dict[str, int]]:
    """p50/p90/p99/max of prompt, chosen, rejected and whole-pair token counts."""
    return percentiles(
        {
            "prompt": [r.prompt_tokens for r in rows],
            "chosen": [r.chosen_tokens for r in rows],
            "rejected": [r.rejected_tokens for r in rows],
            "pair": [2 * r.prompt_tokens + r.chosen_tokens + r.rejected_tokens for r in rows],
        }
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_input_arguments(parser, "pairs")
    parser.add_argument("--max-prompt-length", type=int, default=512, help="drop pairs whose prompt has more tokens")
    parser.add_argument(
        "--max-length", type=int, default=1024, help="drop pairs whose prompt + longer response has more tokens"
    )
    return parse_input_arguments(parser, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    limits = {
        "prompt_too_long": ("--max-prompt-length", args.max_prompt_length),
        "too_long": ("--max-length", args.max_length),
    }
    tally = Tally(limits=limits)
    try:
        pairs = read_pairs(args.input, args.split, args.skip_invalid, tally, args.columns, args.config_name)
        tokenizer = load_tokenizer(args)
        rows = measure_and_filter(pairs, tokenizer, args.max_prompt_length, args.max_length, tally)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {none_kept('pairs', args.input, tally)}", file=sys.stderr)
        return 2
    in_validation = split_by_prompt([r.pair.prompt for r in rows], args.validation_fraction, args.seed)
    train = [r for i, r in enumerate(rows) if i not in in_validation]
    validation = [r for i, r in enumerate(rows) if i in in_validation]
    os.makedirs(args.out, exist_ok=True)
    splits = {split: split_rows for split, split_rows in (("train", train), ("validation", validation)) if split_rows}
    n_prompts = {}
    for split, split_rows in splits.items():
        write_pairs(split_rows, os.path.join(args.out, f"{split}.parquet"))
        n_prompts[split] = write_prompts(split_rows, os.path.join(args.out, f"prompts_{split}.parquet"))
    lengths = length_percentiles(rows)
    counts = {"train": len(train), "validation": len(validation), "prompts": n_prompts}
    write_summary(os.path.join(args.out, "summary.json"), args, tokenizer, tally, counts, lengths)
    print(format_report(tally, len(train), len(validation), lengths))
    print(f"wrote {args.out}/{{{','.join(f'{n},prompts_{n}' for n in splits)}}}.parquet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
