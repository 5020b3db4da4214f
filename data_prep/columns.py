"""The layouts users have, read as they are: column mapping, field renames and final-answer extraction,
applied to every raw row before it is parsed (data_prep/splits.read_rows).

    --prompt-column question                 # GSM8K: the prompt is the 'question' column
    --response-column answer                 # ... and SFT's response its worked 'answer'
    --field answer=final                     # the ground-truth field 'answer' is read from column 'final'
    --extract answer=gsm8k                   # ... keeping the final answer after '#### ' (boxed: \\boxed{...})

A mapped column that a row lacks is a bad mapping: :class:`~data_prep.sources.DataError` naming the
flag, the column and the columns the row has (exit 2, even with --skip-invalid). A row whose field
holds no final answer to extract is malformed (:class:`~data_prep.preference_rows.InvalidRow`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from data_prep.preference_rows import InvalidRow
from data_prep.sources import DataError

CANONICAL = ("prompt", "response", "chosen", "rejected", "messages")  # the columns the row parsers read


def gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K solution, after its last ``####`` (thousands separators dropped)."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "") or None


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), as MATH solutions give their answer."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i].strip()
    return None


EXTRACTORS = {"gsm8k": gsm8k_answer, "boxed": boxed_answer}


@dataclass(frozen=True)
class ColumnMap:
    """Where each column a parser reads comes from in the input, and the answers to extract."""

    columns: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (input column, the flag that said so)
    extract: dict[str, str] = field(default_factory=dict)  # field -> an EXTRACTORS kind

    def apply(self, location: str, row: Any) -> Any:
        """``row`` with its mapped columns under the names the parsers read and its answers extracted."""
        if not isinstance(row, dict) or not (self.columns or self.extract):
            return row
        out = dict(row)
        for name, (column, flag) in self.columns.items():
            if column not in row:
                raise DataError(f"{location}: no column '{column}' ({flag}); the columns here: {sorted(row)}")
            out[name] = row[column]
        for name, kind in self.extract.items():
            value = out.get(name)
            if value is None:
                continue  # the parser names a missing field
            answer = EXTRACTORS[kind](str(value))
            if answer is None:
                raise InvalidRow("no_answer", name, f"no {kind} final answer in {str(value)[-80:]!r}")
            out[name] = answer
        return out


AS_GIVEN = ColumnMap()  # every column under the name the parsers read


def add_column_arguments(parser: argparse.ArgumentParser) -> None:
    """The column-mapping flags every prepare_* script takes."""
    for name in CANONICAL:
        parser.add_argument(f"--{name}-column", metavar="COLUMN", help=f"the input column holding '{name}'")
    parser.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="NAME=COLUMN",
        help="read the field NAME (e.g. a ground truth --fields keeps) from COLUMN; repeatable",
    )
    parser.add_argument(
        "--extract",
        action="append",
        default=[],
        metavar="NAME=KIND",
        help=f"keep only the final answer in field NAME: KIND {' or '.join(EXTRACTORS)} ('#### x' or \\boxed{{x}})",
    )


def column_map(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ColumnMap:
    """The :class:`ColumnMap` of the parsed flags; a malformed ``NAME=VALUE`` is a usage error (exit 2)."""
    columns = {name: (column, f"--{name}-column") for name in CANONICAL if (column := getattr(args, f"{name}_column"))}
    for flag, pairs in (("--field", args.field), ("--extract", args.extract)):
        for pair in pairs:
            name, _, value = pair.partition("=")
            if not name or not value:
                parser.error(f"{flag} {pair!r}: expected NAME=VALUE")
            if flag == "--extract" and value not in EXTRACTORS:
                parser.error(f"{flag} {pair!r}: KIND must be one of {sorted(EXTRACTORS)}")
    columns |= {
        name: (column, f"--field {name}={column}") for name, _, column in (p.partition("=") for p in args.field)
    }
    return ColumnMap(columns, {name: kind for name, _, kind in (p.partition("=") for p in args.extract)})
