"""Convert chat data (conversations, prompt/response rows, or the chosen side of preference data)
into parquet splits for supervised fine-tuning (train/train_sft.py).

    python -m data_prep.prepare_sft --input demos.jsonl [--input hh.jsonl.gz ...] \\
        --tokenizer path/to/model --out data/ [--validation-fraction 0.05] [--seed 0]

Writes ``sft_train.parquet`` and ``sft_validation.parquet`` (columns ``source`` = ``file:line``,
``messages``, ``num_tokens``, ``trained_tokens``: the assistant's) and ``sft_summary.json`` into
``--out``, so they can sit beside the preference files of data_prep/prepare_preferences.py. The
split is by prompt (the messages before the first assistant turn) and deterministic by seed; a
split without rows is not written. Row shapes: see data_prep/conversation_rows.py.

A malformed row stops the run with ``file:line: field 'x': ...``; ``--skip-invalid`` skips and
counts it instead. Conversations with an empty assistant turn or over ``--max-length`` tokens are
dropped and counted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import pyarrow as pa

from data_prep.conversation_rows import parse_conversation_row
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
from engine.data.conversations import tokenize_conversations

SFT_SCHEMA = pa.schema(
    [("source", pa.string()), ("messages", MESSAGES), ("num_tokens", pa.int32()), ("trained_tokens", pa.int32())]
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_input_arguments(parser, "conversations")
    parser.add_argument("--max-length", type=int, default=1024, help="drop conversations with more tokens")
    return parse_input_arguments(parser, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tally = Tally(limits={"too_long": ("--max-length", args.max_length)})
    try:
        parsed = read_rows(
            args.input, args.split, args.skip_invalid, tally, parse_conversation_row, args.columns, args.config_name
        )
        tokenizer = load_tokenizer(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for start in range(0, len(parsed), 512):
        part = parsed[start : start + 512]
        for (source, messages), tokens in zip(part, tokenize_conversations(tokenizer, [m for _, m in part])):
            if tokens.num_tokens > args.max_length:
                tally.dropped["too_long"] += 1
            else:
                rows.append(
                    {
                        "source": source,
                        "messages": messages,
                        "num_tokens": tokens.num_tokens,
                        "trained_tokens": tokens.num_trained,
                    }
                )
    if not rows:
        print(f"error: {none_kept('conversations', args.input, tally)}", file=sys.stderr)
        return 2
    prompts = [r["messages"][: next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")] for r in rows]
    in_validation = split_by_prompt(prompts, args.validation_fraction, args.seed)
    splits = {
        "train": [r for i, r in enumerate(rows) if i not in in_validation],
        "validation": [rows[i] for i in sorted(in_validation)],
    }
    os.makedirs(args.out, exist_ok=True)
    for split, split_rows in splits.items():
        if split_rows:
            write_atomically(
                pa.Table.from_pylist(split_rows, schema=SFT_SCHEMA), os.path.join(args.out, f"sft_{split}.parquet")
            )
    lengths = percentiles(
        {"conversation": [r["num_tokens"] for r in rows], "trained": [r["trained_tokens"] for r in rows]}
    )
    counts = {split: len(split_rows) for split, split_rows in splits.items()}
    write_summary(os.path.join(args.out, "sft_summary.json"), args, tokenizer, tally, counts, lengths)
    print(format_report(tally, len(splits["train"]), len(splits["validation"]), lengths))
    print(f"wrote {args.out}/{{{','.join(f'sft_{n}' for n, r in splits.items() if r)}}}.parquet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
