"""The run directory's JSON-lines files (metrics, events, samples): one record a line, each with a ``step``."""

from __future__ import annotations

import json
import os
from typing import Any


def truncate_after(path: str, step: int) -> None:
    """Keep the records of ``path`` up to ``step`` byte for byte; drop later ones and a half-written last line."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a metrics/events/samples .jsonl file, in order. A run still writing may
    have a half-written last line: it is left out."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise
    return records
