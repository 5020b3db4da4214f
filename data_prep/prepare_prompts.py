"""Convert prompt-only rows, with the ground truth a reward function checks against, into PPO prompt files.

    python -m data_prep.prepare_prompts --input rows.jsonl [--input more.parquet ...] \\
        --tokenizer path/to/model --out data/ [--fields answer,tests] [--validation-fraction 0.05] [--seed 0] \\
        [--prompt-template "{prompt} ..."] [--system-prompt TEXT] [--tools calculator]

A row has ``prompt`` (a string: one user turn, or a message list ending with a user turn) and
every column named by ``--fields`` (e.g. ``{"prompt": "What is 7 + 5?", "answer": "12"}``); other
keys are ignored. Writes ``prompts_train.parquet`` and ``prompts_validation.parquet`` (the names
data_prep/prepare_preferences.py gives its prompt files; columns ``source`` = ``file:line``,
``prompt`` messages, ``prompt_tokens``, then one column per field with its values as given) and
``prompts_summary.json`` into ``--out``. A field's column has the arrow type of its values
(``"12"`` a string, ``12`` an int64, ``[{"input": ..., "output": ...}]`` a list of structs); a
row whose value has another type than the first row's is malformed. The split is by prompt and
deterministic by seed; a split without rows is not written.

A malformed row (no prompt, a field missing or null, a field of another type) stops the run with
``file:line: field 'x': ...``; ``--skip-invalid`` skips and counts it instead. Repeated prompts
(the first is kept) and prompts over ``--max-prompt-tokens`` are dropped and counted. An
instruction template, a system prompt and tool schemas can be added to every prompt
(data_prep/prompt_options.py); the summary records them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from data_prep.preference_rows import DroppedRow, InvalidRow, Message, parse_messages
from data_prep.prepare_preferences import PROMPT_SCHEMA
from data_prep.prompt_options import NO_OPTIONS, PromptOptions, add_prompt_arguments, prompt_options
from data_prep.sources import BadJSON, DataError
from data_prep.splits import (
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
from engine.data.chat import render_prompt

OWN_COLUMNS = tuple(PROMPT_SCHEMA.names)  # source, prompt, prompt_tokens: no field may take these names


@dataclass(frozen=True)
class PromptRow:
    """A parsed row: its prompt messages and the declared fields' values, as given."""

    prompt: list[Message]
    fields: dict[str, Any]


def prompt_row_parser(names: Sequence[str], options: PromptOptions = NO_OPTIONS) -> Callable[[Any], PromptRow]:
    """A parser of one raw row that keeps the fields ``names`` and applies ``options`` to its prompt;
    see the module docstring."""

    def parse(row: Any) -> PromptRow:
        if isinstance(row, BadJSON):
            raise InvalidRow("bad_json", "<row>", row.error)
        if not isinstance(row, dict):
            raise InvalidRow("not_object", "<row>", f"expected a JSON object, got {type(row).__name__}")
        for name in ("prompt", *names):
            if row.get(name) is None:
                raise InvalidRow("missing_field", name, "missing")
        prompt = parse_messages(row["prompt"], "prompt", allow_string=True)
        if prompt[-1]["role"] != "user":
            raise InvalidRow("bad_message", "prompt", f"the last message must be 'user', got {prompt[-1]['role']!r}")
        if not prompt[-1]["content"].strip():
            raise DroppedRow("empty_prompt")
        return PromptRow(options.apply(row, prompt), {name: row[name] for name in names})

    return parse


def drop_repeated_prompts(rows: list[tuple[str, PromptRow]], tally: Tally) -> list[tuple[str, PromptRow]]:
    """The first row of each prompt; the others are dropped and counted."""
    kept, seen = [], set()
    for location, row in rows:
        key = json.dumps(row.prompt, sort_keys=True)
        if key in seen:
            tally.dropped["duplicate_prompt"] += 1
        else:
            seen.add(key)
            kept.append((location, row))
    return kept


def field_types(
    rows: list[tuple[str, PromptRow]], skip_invalid: bool, tally: Tally
) -> tuple[list[tuple[str, PromptRow]], dict[str, pa.DataType]]:
    """The arrow type of each field's column, and the rows whose values have it.

    The first row sets a field's type; types that differ only by nulls inside them (``[]`` and
    ``[1]``, ``{"a": None}`` and ``{"a": 1}``) agree, any other difference (an int64 and a
    string, an int64 and a double) makes the later row malformed: DataError naming it and the
    first row, unless ``skip_invalid`` (then skipped and counted).
    """
    types: dict[str, pa.DataType] = {}
    first: dict[str, str] = {}
    kept = []
    for location, row in rows:
        try:
            agreed = {
                name: _agreed_type(types.get(name), first.get(name), name, value) for name, value in row.fields.items()
            }
        except InvalidRow as e:
            if not skip_invalid:
                raise DataError(f"{location}: {e} (--skip-invalid skips and counts such rows)") from None
            tally.invalid[e.reason] += 1
            continue
        for name, value_type in agreed.items():
            types[name] = value_type
            first.setdefault(name, location)
        kept.append((location, row))
    return kept, types


def _agreed_type(known: pa.DataType | None, first: str | None, name: str, value: Any) -> pa.DataType:
    try:
        value_type = pa.array([value]).type
    except (pa.ArrowException, OverflowError, TypeError) as e:
        raise InvalidRow("bad_value", name, f"cannot be stored in a parquet column ({e})") from None
    if known is None:
        return value_type
    try:
        return pa.unify_schemas([pa.schema([(name, known)]), pa.schema([(name, value_type)])]).field(name).type
    except (pa.ArrowException, TypeError):
        raise InvalidRow(
            "mixed_types", name, f"{value_type} here but {known} in {first} (a field's values must have one type)"
        ) from None


def prompt_lengths(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[list[Message]], chunk: int = 512) -> list[int]:
    """Tokens of each prompt as the policy sees it (chat template, assistant header included)."""
    lengths = []
    for start in range(0, len(prompts), chunk):
        texts = [render_prompt(tokenizer, p) for p in prompts[start : start + chunk]]
        # The template already writes every special token it wants (BOS included).
        lengths += [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return lengths


def parse_fields(parser: argparse.ArgumentParser, text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if len(set(names)) != len(names):
        parser.error(f"--fields names a column twice: {text!r}")
    if reserved := [name for name in names if name in OWN_COLUMNS]:
        parser.error(f"--fields {reserved} would replace the prompt files' own column(s) {list(OWN_COLUMNS)}")
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_input_arguments(parser, "prompts")
    parser.add_argument(
        "--fields", default="", help="comma-separated columns every row must have (ground truth), e.g. answer,tests"
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="drop prompts with more tokens")
    add_prompt_arguments(parser)
    args = parse_input_arguments(parser, argv)
    args.fields = parse_fields(parser, args.fields)
    args.options = prompt_options(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tally = Tally(limits={"prompt_too_long": ("--max-prompt-tokens", args.max_prompt_tokens)})
    try:
        tokenizer = load_tokenizer(args)
        args.options.check_tokenizer(tokenizer)
        parse = prompt_row_parser(args.fields, args.options)
        parsed = read_rows(args.input, args.split, args.skip_invalid, tally, parse, args.columns, args.config_name)
        parsed, types = field_types(drop_repeated_prompts(parsed, tally), args.skip_invalid, tally)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for (source, row), n_tokens in zip(parsed, prompt_lengths(tokenizer, [r.prompt for _, r in parsed])):
        if n_tokens > args.max_prompt_tokens:
            tally.dropped["prompt_too_long"] += 1
        else:
            rows.append({"source": source, "prompt": row.prompt, "prompt_tokens": n_tokens, **row.fields})
    if not rows:
        print(f"error: {none_kept('prompts', args.input, tally)}", file=sys.stderr)
        return 2
    in_validation = split_by_prompt([r["prompt"] for r in rows], args.validation_fraction, args.seed)
    splits = {
        "train": [r for i, r in enumerate(rows) if i not in in_validation],
        "validation": [rows[i] for i in sorted(in_validation)],
    }
    schema = PROMPT_SCHEMA
    for name in args.fields:
        schema = schema.append(pa.field(name, types[name]))
    os.makedirs(args.out, exist_ok=True)
    for split, split_rows in splits.items():
        if split_rows:
            table = pa.Table.from_pylist(split_rows, schema=schema)
            write_atomically(table, os.path.join(args.out, f"prompts_{split}.parquet"))
    lengths = percentiles({"prompt": [r["prompt_tokens"] for r in rows]})
    counts = {
        "fields": {name: str(types[name]) for name in args.fields},
        **args.options.summary(),
        **{split: len(split_rows) for split, split_rows in splits.items()},
    }
    write_summary(os.path.join(args.out, "prompts_summary.json"), args, tokenizer, tally, counts, lengths)
    print(format_report(tally, len(splits["train"]), len(splits["validation"]), lengths))
    print(f"wrote {args.out}/{{{','.join(f'prompts_{n}' for n, r in splits.items() if r)}}}.parquet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
