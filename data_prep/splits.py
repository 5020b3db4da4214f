"""What the prepare_* scripts share: reading and counting rows, the split by prompt, atomic
parquet writes and the end-of-run table."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.columns import AS_GIVEN, ColumnMap, add_column_arguments, column_map
from data_prep.preference_rows import DroppedRow, InvalidRow, Message
from data_prep.sources import DataError, iter_rows

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
T = TypeVar("T")


@dataclass
class Tally:
    """Counts of what happened to the input rows."""

    read: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> rows (well-formed, unused)
    invalid: Counter = field(default_factory=Counter)  # reason -> rows (malformed, skipped)

    @property
    def kept(self) -> int:
        return self.read - sum(self.dropped.values()) - sum(self.invalid.values())


def read_rows(
    inputs: Sequence[str],
    split: str,
    skip_invalid: bool,
    tally: Tally,
    parse: Callable[[Any], T],
    columns: ColumnMap = AS_GIVEN,
    config_name: str | None = None,
) -> list[tuple[str, T]]:
    """``(location, parse(row))`` of every input row, its columns mapped first (``columns``); malformed
    rows raise DataError unless ``skip_invalid``, a bad mapping always; dropped and skipped rows are
    counted by reason. ``split`` and ``config_name``: of a `datasets` name or directory."""
    parsed = []
    for source in inputs:
        for location, raw in iter_rows(source, split, config_name):
            tally.read += 1
            try:
                parsed.append((location, parse(columns.apply(location, raw))))
            except DroppedRow as e:
                tally.dropped[e.reason] += 1
            except InvalidRow as e:
                if not skip_invalid:
                    raise DataError(f"{location}: {e} (--skip-invalid skips and counts such rows)") from None
                tally.invalid[e.reason] += 1
    return parsed


def split_by_prompt(prompts: Sequence[Sequence[Message]], validation_fraction: float, seed: int) -> set[int]:
    """Indices of the validation rows of a deterministic split in which every prompt lands in one split only.

    Prompt groups are visited in a seeded random order and given to validation until it holds
    ``round(validation_fraction * len(prompts))`` rows.
    """
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(json.dumps(prompt, sort_keys=True), []).append(i)
    order = np.random.default_rng(seed).permutation(len(groups))
    members = list(groups.values())
    target = round(validation_fraction * len(prompts))
    in_validation: set[int] = set()
    for g in order:
        if len(in_validation) >= target:
            break
        in_validation.update(members[g])
    return in_validation


def write_atomically(table: pa.Table, path: str) -> None:
    # Written beside the target and renamed when whole: a crash never leaves a truncated file.
    tmp = f"{path}.tmp-{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def percentiles(columns: dict[str, list[int]]) -> dict[str, dict[str, int]]:
    """p50/p90/p99/max of each column of token counts."""
    stats = {}
    for name, values in columns.items():
        a = np.asarray(values or [0])
        stats[name] = {q: int(np.percentile(a, p)) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))}
        stats[name]["max"] = int(a.max())
    return stats


def format_report(tally: Tally, n_train: int, n_validation: int, lengths: dict[str, dict[str, int]]) -> str:
    """The end-of-run table: rows by fate and reason, then token-length percentiles."""
    lines = ["rows", f"  {'read':<28}{tally.read:>8}", f"  {'kept':<28}{tally.kept:>8}"]
    lines += [f"    {'train':<26}{n_train:>8}", f"    {'validation':<26}{n_validation:>8}"]
    for title, counts in (("dropped", tally.dropped), ("invalid (skipped)", tally.invalid)):
        lines.append(f"  {title:<28}{sum(counts.values()):>8}")
        lines += [f"    {reason:<26}{n:>8}" for reason, n in sorted(counts.items())]
    lines.append(f"tokens {'':<21}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}")
    for name, s in lengths.items():
        lines.append(f"  {name:<27}{s['p50']:>8}{s['p90']:>8}{s['p99']:>8}{s['max']:>8}")
    return "\n".join(lines)


def add_input_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The arguments every prepare_* script takes: inputs, tokenizer, output, split and row handling."""
    parser.add_argument(
        "--input",
        action="append",
        required=True,
        help="file (.jsonl/.jsonl.gz/.json/.parquet) or datasets name/path; repeatable",
    )
    parser.add_argument("--split", default="train", help="split to read from a datasets name/path")
    parser.add_argument("--config-name", help="configuration of a datasets name/path (GSM8K: main)")
    parser.add_argument(
        "--tokenizer", required=True, help=f"tokenizer (model dir) whose chat template renders the {what}"
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--validation-fraction",
        type=float,
        default=0.05,
        help=f"fraction of {what} held out, split by prompt (1: all of them, a validation-only file)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    parser.add_argument(
        "--skip-invalid", action="store_true", help="skip malformed rows (counted by reason) instead of failing"
    )
    add_column_arguments(parser)


def parse_input_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if not 0.0 <= args.validation_fraction <= 1.0:
        parser.error(f"--validation-fraction must be in [0, 1], got {args.validation_fraction}")
    args.columns = column_map(parser, args)
    return args
