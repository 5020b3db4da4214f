"""Reading rows from every supported input kind, with locations that point at the row."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.sources import BadJSON, DataError, iter_rows

ROWS = [{"prompt": "p1", "chosen": "c1", "rejected": "r1"}, {"prompt": "p2", "chosen": "c2", "rejected": "r2"}]


def test_jsonl_skips_blank_lines_and_numbers_real_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    assert list(iter_rows(str(path))) == [(f"{path}:1", ROWS[0]), (f"{path}:3", ROWS[1])]


def test_jsonl_gz(tmp_path):
    path = tmp_path / "a.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    assert [row for _, row in iter_rows(str(path))] == ROWS


def test_bad_json_line_is_a_value_not_a_crash(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n" + json.dumps(ROWS[1]) + "\n")
    rows = list(iter_rows(str(path)))
    assert rows[1][0] == f"{path}:2" and isinstance(rows[1][1], BadJSON)
    assert rows[2] == (f"{path}:3", ROWS[1])


def test_json_array_elements_are_located_by_their_line(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("[\n  " + json.dumps(ROWS[0]) + ",\n\n  " + json.dumps(ROWS[1], indent=2) + "\n]\n")
    assert list(iter_rows(str(path))) == [(f"{path}:2", ROWS[0]), (f"{path}:4", ROWS[1])]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"a": 1}', "one top-level array"),
        ('[{"a": 1},\n {"a": }]', ":2: not valid JSON"),
        ('[{"a": 1} {"a": 2}]', ":1: expected ',' or ']'"),
        ('[{"a": 1},', "not valid JSON"),
    ],
)
def test_malformed_json_files_name_the_line(tmp_path, text, message):
    path = tmp_path / "a.json"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        list(iter_rows(str(path)))


def test_parquet_rows(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert list(iter_rows(str(path))) == [(f"{path}[row 1]", ROWS[0]), (f"{path}[row 2]", ROWS[1])]


def test_datasets_saved_to_disk(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    datasets.Dataset.from_list(ROWS[:1]).save_to_disk(str(tmp_path / "d"))
    assert [row for _, row in iter_rows(str(tmp_path / "dd"), split="train")] == ROWS
    assert [loc for loc, _ in iter_rows(str(tmp_path / "d"))] == [f"{tmp_path / 'd'}[train row 1]"]


def test_a_missing_split_lists_the_splits_there_are(tmp_path, tiny_model_dir, capsys):
    """UltraFeedback-binarized's splits, saved to disk and as the hub lays out its files: asked for
    the default 'train', the script stops (exit 2) naming the source, the split and the ones there are."""
    import datasets

    from data_prep import prepare_preferences

    pairs = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train_prefs": pairs, "test_prefs": pairs}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for split in ("train_prefs", "test_prefs"):
        pairs.to_parquet(str(tmp_path / "hub" / "data" / f"{split}-00000-of-00001.parquet"))
    for source in (tmp_path / "saved", tmp_path / "hub"):
        argv = ["--input", str(source), "--tokenizer", str(tiny_model_dir), "--out", str(tmp_path / "out")]
        assert prepare_preferences.main(argv) == 2
        err = capsys.readouterr().err
        assert f"error: {source}: no split 'train' (--split); its splits: " in err, err
        assert "train_prefs" in err and "test_prefs" in err
        assert [row for _, row in iter_rows(str(source), split="test_prefs")] == ROWS


def test_a_configuration_of_a_saved_directory_is_refused_by_name(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: --config-name main applies to a datasets hub name or script"):
        list(iter_rows(str(tmp_path / "dd"), config_name="main"))


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        list(iter_rows(str(tmp_path / "missing.jsonl")))
    (tmp_path / "a.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        list(iter_rows(str(tmp_path / "a.csv")))
