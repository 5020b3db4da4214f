"""The preparation CLI end to end: splits, counts, errors, limits, round trip, real HH data."""

from __future__ import annotations

import gzip
import json

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from data_prep import prepare_preferences

SPLITS = ("train", "validation", "prompts_train", "prompts_validation")


def run(tmp_path, inputs, tokenizer, *extra, out="out"):
    args = [a for i in inputs for a in ("--input", str(i))]
    code = prepare_preferences.main([*args, "--tokenizer", str(tokenizer), "--out", str(tmp_path / out), *extra])
    return code, tmp_path / out


def read(out, split):
    return pq.read_table(out / f"{split}.parquet").to_pylist()


def test_synthetic_split_is_by_prompt_and_complete(tmp_path, synthetic_pairs, tiny_model_dir, capsys):
    code, out = run(tmp_path, [synthetic_pairs], tiny_model_dir, "--validation-fraction", "0.1")
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    train, validation = read(out, "train"), read(out, "validation")
    assert summary["read"] == summary["kept"] == len(train) + len(validation) == 600
    assert 50 <= len(validation) <= 70  # 10% of 600, give or take the last prompt group
    key = lambda row: json.dumps(row["prompt"])
    assert not {key(r) for r in train} & {key(r) for r in validation}
    prompts = read(out, "prompts_train")
    assert len(prompts) == len({key(r) for r in train}) == len({key(r) for r in prompts})
    assert {r["source"].rsplit(":", 1)[0] for r in train} == {str(synthetic_pairs)}
    assert "validation" in capsys.readouterr().out


def test_token_lengths_match_the_chat_template(tmp_path, synthetic_pairs, tiny_model_dir):
    _code, out = run(tmp_path, [synthetic_pairs], tiny_model_dir)
    row = read(out, "train")[0]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt_ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False)
    full_ids = tok.apply_chat_template(
        row["prompt"] + [{"role": "assistant", "content": row["chosen"]}], return_dict=False
    )
    assert row["prompt_tokens"] == len(prompt_ids)
    assert row["chosen_tokens"] == len(full_ids) - len(prompt_ids)
    assert full_ids[-2] == tok.convert_tokens_to_ids("<|im_end|>")  # the turn is closed


def test_split_is_deterministic_by_seed(tmp_path, synthetic_pairs, tiny_model_dir):
    outs = [run(tmp_path, [synthetic_pairs], tiny_model_dir, "--seed", s, out=f"o{i}")[1] for i, s in enumerate("001")]
    assert read(outs[0], "validation") == read(outs[1], "validation")
    assert read(outs[0], "validation") != read(outs[2], "validation")


def test_margin_and_components_survive_a_parquet_round_trip(tmp_path, tiny_model_dir):
    rows = [
        {
            "prompt": f"question {i}",
            "chosen": f"good {i}",
            "rejected": f"bad {i}",
            "margin": i / 2,
            "components": {"a": 1, "b": -1},
        }
        for i in range(10)
    ] + [{"prompt": "plain", "chosen": "yes", "rejected": "no"}]
    src = tmp_path / "rows.json"
    src.write_text(json.dumps(rows))
    _, first = run(tmp_path, [src], tiny_model_dir, "--validation-fraction", "0", out="first")
    _, second = run(tmp_path, [first / "train.parquet"], tiny_model_dir, "--validation-fraction", "0", out="second")
    a, b = read(first, "train"), read(second, "train")
    fields = (
        "prompt",
        "chosen",
        "rejected",
        "margin",
        "components",
        "prompt_tokens",
        "chosen_tokens",
        "rejected_tokens",
    )
    assert [{f: r[f] for f in fields} for r in a] == [{f: r[f] for f in fields} for r in b]
    assert a[3]["margin"] == 1.5 and dict(a[3]["components"]) == {"a": 1, "b": -1}
    assert a[10]["margin"] is None and a[10]["components"] == []
    assert b[0]["source"] == f"{first / 'train.parquet'}[row 1]"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"prompt": "p", "chosen": "c", "rejected": "r"}


def test_invalid_row_stops_with_file_line_and_field(tmp_path, tiny_model_dir, capsys):
    src = write_jsonl(
        tmp_path / "bad.jsonl", [GOOD, GOOD, {"prompt": "p", "chosen": "c", "rejected": "r", "margin": "x"}]
    )
    code, out = run(tmp_path, [src], tiny_model_dir)
    assert code == 2
    err = capsys.readouterr().err
    assert f"{src}:3: field 'margin'" in err and "--skip-invalid" in err
    assert not out.exists()  # nothing half-written


def test_skip_invalid_counts_every_reason(tmp_path, tiny_model_dir, capsys):
    rows = [
        GOOD,
        "{not json",
        "[1]",
        {"prompt": "p", "chosen": "c"},
        {"prompt": 1, "chosen": "c", "rejected": "r"},
        {"prompt": [{"role": "x", "content": "c"}], "chosen": "c", "rejected": "r"},
        {**GOOD, "margin": "x"},
        {**GOOD, "components": {"h": 5}},
        {"chosen": "no turns", "rejected": "no turns either"},
        {"prompt": "p", "chosen": "same", "rejected": "same"},
        {"prompt": "p", "chosen": "", "rejected": "r"},
    ]
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    code, out = run(tmp_path, [src], tiny_model_dir, "--skip-invalid", "--validation-fraction", "0")
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["read"] == 11 and summary["kept"] == 1
    assert summary["invalid"] == {
        "bad_json": 1,
        "not_object": 1,
        "missing_field": 1,
        "wrong_type": 1,
        "bad_message": 1,
        "bad_margin": 1,
        "bad_components": 1,
        "bad_dialogue": 1,
    }
    assert summary["dropped"] == {"identical_responses": 1, "empty_response": 1}
    printed = capsys.readouterr().out
    assert "bad_components" in printed and "identical_responses" in printed


def test_a_validation_only_file(tmp_path, synthetic_pairs, tiny_model_dir, capsys):
    code, out = run(tmp_path, [synthetic_pairs], tiny_model_dir, "--validation-fraction", "1")
    assert code == 0
    assert len(read(out, "validation")) == 600 and len(read(out, "prompts_validation")) > 0
    assert not (out / "train.parquet").exists() and not (out / "prompts_train.parquet").exists()
    assert f"wrote {out}/{{validation,prompts_validation}}.parquet" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run(tmp_path, [synthetic_pairs], tiny_model_dir, "--validation-fraction", "1.5")


def test_length_limits_drop_and_count(tmp_path, tiny_model_dir, capsys):
    rows = [
        {"prompt": "short", "chosen": "ok", "rejected": "no"},
        {"prompt": "word " * 60, "chosen": "ok", "rejected": "no"},
        {"prompt": "short", "chosen": "ok " * 80, "rejected": "no"},
    ]
    src = write_jsonl(tmp_path / "long.jsonl", rows)
    code, out = run(
        tmp_path, [src], tiny_model_dir, "--max-prompt-length", "40", "--max-length", "60", "--validation-fraction", "0"
    )
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and summary["kept"] == 1
    assert summary["dropped"] == {"prompt_too_long": 1, "too_long": 1}
    # why, naming the flag that keeps them, in the summary and the printed table
    assert summary["dropped_why"] == {
        "prompt_too_long": "more than --max-prompt-length 40 tokens (a higher --max-prompt-length keeps them)",
        "too_long": "more than --max-length 60 tokens (a higher --max-length keeps them)",
    }
    printed = capsys.readouterr().out
    assert "    too_long                         1  more than --max-length 60 tokens (a higher --max-length" in printed


def test_no_usable_rows_is_an_error(tmp_path, tiny_model_dir, capsys):
    src = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "p", "chosen": "x", "rejected": "x"}])
    assert run(tmp_path, [src], tiny_model_dir)[0] == 2
    err = capsys.readouterr().err
    assert f"no usable pairs in ['{src}'] (read 1; 1 dropped as identical_responses: chosen and rejected are" in err


def test_real_hh_harmless_converts_cleanly(tmp_path, hh_path, hh_tokenizer):
    code, out = run(tmp_path, [hh_path], hh_tokenizer, "--max-prompt-length", "100000", "--max-length", "100000")
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    # Known facts of this file: 5 rows whose dialogues diverge before the last turn (a response
    # carrying extra turns), 4 with an empty final response, nothing malformed.
    assert summary["read"] == 2312
    assert summary["dropped"] == {"turn_mismatch": 5, "empty_response": 4}
    assert summary["invalid"] == {}
    rows = read(out, "train") + read(out, "validation")
    assert len(rows) == summary["kept"] == 2303

    # Independent count of prompt turns from the raw text: turn markers before the last
    # "\n\nAssistant:" of each row that was kept.
    with gzip.open(hh_path, "rt") as f:
        raw = [json.loads(line) for line in f]
    kept_lines = {int(r["source"].rsplit(":", 1)[1]) for r in rows}
    expected_turns = 0
    for line_no, row in enumerate(raw, start=1):
        if line_no in kept_lines:
            prefix = row["chosen"][: row["chosen"].rfind("\n\nAssistant:")]
            expected_turns += prefix.count("\n\nHuman:") + prefix.count("\n\nAssistant:")
    assert sum(len(r["prompt"]) for r in rows) == expected_turns
    assert sum(len(r["prompt"]) > 1 for r in rows) > 1000  # most of the file is multi-turn
    for r in rows:
        assert r["prompt"][0]["role"] == "user" and r["prompt"][-1]["role"] == "user"
        assert r["chosen"] == r["chosen"].strip() and r["chosen"] and r["chosen"] != r["rejected"]
        assert r["prompt_tokens"] > 0 and r["chosen_tokens"] > 0


def test_real_hh_default_limits_drop_long_rows(tmp_path, hh_path, hh_tokenizer):
    code, out = run(tmp_path, [hh_path], hh_tokenizer)
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and summary["dropped"]["prompt_too_long"] > 0
    assert summary["kept"] + sum(summary["dropped"].values()) == 2312
    assert summary["token_lengths"]["prompt"]["max"] <= 512
