"""What the prepare_* scripts share: the tokenizer with its chat template, reading and counting rows,
the split by prompt, atomic parquet writes, the summary and the end-of-run table."""

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
from transformers import PreTrainedTokenizerBase

from data_prep.columns import AS_GIVEN, ColumnMap, add_column_arguments, column_map
from data_prep.preference_rows import DroppedRow, InvalidRow, Message
from data_prep.sources import DataError, OptionError, iter_rows
from engine.data import chat_templates
from engine.run_config.chat_template import BUILT_IN, TemplateError, resolve

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
T = TypeVar("T")
# Why a well-formed row is dropped, by reason; the length limits' reasons are each script's (Tally.limits).
WHY_DROPPED = {
    "duplicate_prompt": "the prompt of an earlier row (the first is kept)",
    "empty_prompt": "an empty last user turn",
    "empty_response": "an empty assistant response",
    "identical_responses": "chosen and rejected are the same text",
    "turn_mismatch": "chosen and rejected dialogues differ before their last turn",
}


@dataclass
class Tally:
    """Counts of what happened to the input rows."""

    read: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> rows (well-formed, unused)
    invalid: Counter = field(default_factory=Counter)  # reason -> rows (malformed, skipped)
    limits: dict[str, tuple[str, int]] = field(default_factory=dict)  # length reason -> (its flag, the value)

    @property
    def kept(self) -> int:
        return self.read - sum(self.dropped.values()) - sum(self.invalid.values())

    def why_dropped(self) -> dict[str, str]:
        """Each reason rows were dropped for, in words, naming the flag that keeps them where one does."""
        why = {}
        for reason in sorted(self.dropped):
            if reason in self.limits:
                flag, value = self.limits[reason]
                why[reason] = f"more than {flag} {value} tokens (a higher {flag} keeps them)"
            else:
                why[reason] = WHY_DROPPED.get(reason, reason)
        return why


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
    rows raise DataError unless ``skip_invalid``, a bad mapping or option (OptionError) always; dropped
    and skipped rows are counted by reason. ``split`` and ``config_name``: of a `datasets` name or directory."""
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
            except OptionError as e:
                raise DataError(f"{location}: {e}") from None
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
    """The end-of-run table: rows by fate and reason (why each drop), then token-length percentiles."""
    lines = ["rows", f"  {'read':<28}{tally.read:>8}", f"  {'kept':<28}{tally.kept:>8}"]
    lines += [f"    {'train':<26}{n_train:>8}", f"    {'validation':<26}{n_validation:>8}"]
    why = tally.why_dropped()
    for title, counts in (("dropped", tally.dropped), ("invalid (skipped)", tally.invalid)):
        lines.append(f"  {title:<28}{sum(counts.values()):>8}")
        lines += [f"    {reason:<26}{n:>8}  {why.get(reason, '')}".rstrip() for reason, n in sorted(counts.items())]
    lines.append(f"tokens {'':<21}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}")
    for name, s in lengths.items():
        lines.append(f"  {name:<27}{s['p50']:>8}{s['p90']:>8}{s['p99']:>8}{s['max']:>8}")
    return "\n".join(lines)


def none_kept(what: str, inputs: Sequence[str], tally: Tally) -> str:
    """The error of a run that kept no row: the rows read and why each kind went."""
    why = tally.why_dropped()
    fates = [f"{n} dropped as {reason}: {why[reason]}" for reason, n in sorted(tally.dropped.items())]
    fates += [f"{n} skipped as {reason}" for reason, n in sorted(tally.invalid.items())]
    return f"no usable {what} in {list(inputs)} (read {tally.read}{''.join('; ' + f for f in fates)})"


def write_summary(
    path: str,
    args: argparse.Namespace,
    tokenizer: PreTrainedTokenizerBase,
    tally: Tally,
    counts: dict[str, Any],
    lengths: dict[str, dict[str, int]],
) -> None:
    """The summary JSON: inputs, tokenizer and chat template, seed, the rows by fate (``counts``: the
    script's own, e.g. per split) with why each was dropped, and the token-length percentiles."""
    summary = {
        "inputs": args.input,
        "tokenizer": args.tokenizer,
        chat_templates.SUMMARY_KEY: chat_templates.summary_record(tokenizer, args.chat_template),
        "seed": args.seed,
        "read": tally.read,
        "kept": tally.kept,
        **counts,
        "dropped": dict(tally.dropped),
        "dropped_why": tally.why_dropped(),
        "invalid": dict(tally.invalid),
        "token_lengths": lengths,
    }
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)


def load_tokenizer(args: argparse.Namespace) -> PreTrainedTokenizerBase:
    """``--tokenizer`` with ``--chat-template`` (checked by :func:`parse_input_arguments`); DataError when it
    cannot be loaded or has no chat template."""
    try:
        return chat_templates.load_tokenizer(args.tokenizer, args.chat_template or "", "--chat-template")
    except TemplateError as e:
        raise DataError(f"--tokenizer {args.tokenizer}: {e}") from None
    except (OSError, ValueError) as e:
        raise DataError(
            f"--tokenizer {args.tokenizer}: no tokenizer could be loaded ({str(e).strip()[:200]})"
        ) from None


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
    parser.add_argument(
        "--chat-template",
        metavar="NAME_OR_FILE",
        help=f"chat template for a tokenizer without one (a base model): {', '.join(BUILT_IN)} or a "
        "Jinja file; give the trainer's model (actor) chat_template the same",
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
    if args.chat_template:
        try:
            resolve(args.chat_template, "--chat-template")
        except TemplateError as e:
            parser.error(str(e))
    args.columns = column_map(parser, args)
    return args
