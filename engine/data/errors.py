"""The error of a data file a run cannot use (the launched scripts exit 2 with it). pyarrow loads when
a file is read: the code sandbox's side (engine/rewards/code_tests.py) needs the standard library only."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa


class DataFileError(ValueError):
    """A data file that cannot be used; the message names the file and what to do."""


def read_parquet(path: str, columns: tuple[str, ...], made_by: str, readers: dict[str, str] | None = None) -> pa.Table:
    """The ``columns`` of a parquet file; :class:`DataFileError` when it cannot be read or lacks one
    (``made_by`` says which tool writes such files; ``readers``: column -> what reads it, for the message)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise DataFileError(
            f"{path}: cannot read it as parquet ({str(e).splitlines()[0]}); {made_by} writes these files"
        ) from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        why = "".join(f"; {readers[c]} reads '{c}'" for c in missing if readers and c in readers)
        raise DataFileError(f"{path}: missing column(s) {missing}{why}; {made_by} writes these files")
    return table.select(list(columns))
