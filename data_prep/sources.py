"""Reading raw rows from .jsonl, .jsonl.gz, .json, .parquet files or a `datasets` name/path.

Every row comes with a location string naming where it came from (``file:line`` for text
files, ``file[row N]`` for tables) so that any later complaint about it can point at it.
A line that is not valid JSON comes back as a :class:`BadJSON` value instead of stopping the
read, so the caller decides between failing and skipping.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq

FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")


class DataError(ValueError):
    """An input that cannot be used, with its location in the message."""


class OptionError(DataError):
    """A row an option cannot be applied to (a template field it lacks): the option's error, not the
    row's, so never skipped; the reader (data_prep/splits.read_rows) prefixes the row's location."""


@dataclass(frozen=True)
class BadJSON:
    """A row whose text is not valid JSON."""

    error: str


def iter_rows(source: str, split: str = "train", config_name: str | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row)`` for every row of a file or dataset, in order.

    ``split`` is used only for `datasets` names and directories (a missing one is refused naming
    those there are), ``config_name`` (a dataset's configuration, e.g. GSM8K's ``main``) only for
    those `load_dataset` reads: given for a saved directory (`load_from_disk`), it is refused.
    """
    if source.endswith(FILE_SUFFIXES) and not os.path.isfile(source):
        raise DataError(f"{source}: no such file")
    if source.endswith((".jsonl", ".jsonl.gz")):
        yield from _iter_jsonl(source)
    elif source.endswith(".json"):
        yield from _iter_json_array(source)
    elif source.endswith(".parquet"):
        yield from _iter_parquet(source)
    elif os.path.isfile(source):
        raise DataError(f"{source}: unsupported file type (use .jsonl, .jsonl.gz, .json or .parquet)")
    else:
        yield from _iter_datasets(source, split, config_name)


def _iter_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{line_no}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{line_no}", BadJSON(f"not valid JSON ({e.msg} at column {e.colno})")


def _iter_json_array(path: str) -> Iterator[tuple[str, Any]]:
    """Elements of a top-level JSON array, each located by the line it starts on."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    newlines = [m.start() for m in re.finditer("\n", text)]

    def line_of(pos: int) -> int:
        return 1 + bisect.bisect_left(newlines, pos)

    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)
    if not text.startswith("[", pos):
        raise DataError(f"{path}: a .json input must hold one top-level array of rows")
    pos = _skip_space(text, pos + 1)
    while not text.startswith("]", pos):
        try:
            row, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            # The rest of the array cannot be located reliably after a syntax error.
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        yield f"{path}:{line_of(pos)}", row
        pos = _skip_space(text, end)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
        elif not text.startswith("]", pos):
            raise DataError(f"{path}:{line_of(pos)}: expected ',' or ']' after an array element")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _iter_parquet(path: str) -> Iterator[tuple[str, Any]]:
    row_no = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            row_no += 1
            yield f"{path}[row {row_no}]", row


def _iter_datasets(source: str, split: str, config_name: str | None) -> Iterator[tuple[str, Any]]:
    import datasets  # imported lazily: slow to import and only needed for this input kind

    saved = os.path.isdir(source) and any(
        os.path.exists(os.path.join(source, name)) for name in ("dataset_dict.json", "dataset_info.json")
    )
    if saved and config_name:
        raise DataError(
            f"{source}: --config-name {config_name} applies to a datasets hub name or script (load_dataset); this is "
            "a saved dataset directory (load_from_disk), which has no configurations: point --input at the one saved"
        )
    try:
        if saved:
            dataset = datasets.load_from_disk(source)
            if isinstance(dataset, datasets.DatasetDict):
                if split not in dataset:
                    raise DataError(_no_split(source, split, list(dataset)))
                dataset = dataset[split]
        else:
            dataset = datasets.load_dataset(source, config_name, split=split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many kinds (missing split or config, bad files, no hub access)
        if (splits := _split_names(source, config_name)) and split not in splits:
            raise DataError(_no_split(source, split, splits)) from None
        where = f" (configuration {config_name!r}, split {split!r})" if config_name else f" (split {split!r})"
        raise DataError(f"{source}{where}: not readable as a datasets name or directory: {e}") from None
    for row_no, row in enumerate(dataset, start=1):
        yield f"{source}[{split} row {row_no}]", row


def _no_split(source: str, split: str, splits: list[str]) -> str:
    return f"{source}: no split {split!r} (--split); its splits: {', '.join(splits)}"


def _split_names(source: str, config_name: str | None) -> list[str]:
    """The splits of a datasets name or script, or [] when they cannot be listed."""
    import datasets

    try:
        return list(datasets.get_dataset_split_names(source, config_name))
    except Exception:  # the error load_dataset raised is the one to report
        return []
