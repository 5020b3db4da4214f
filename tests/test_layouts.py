"""The layouts users arrive with, read as they are (data_prep/columns.py): GSM8K's question/answer with
'#### x', MATH's \\boxed{} in a local `datasets` directory with a configuration and split, and
UltraFeedback-binarized pairs. Rows made here, in those layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_prep import prepare_preferences, prepare_prompts, prepare_sft
from data_prep.columns import boxed_answer, gsm8k_answer

GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many now?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,000 eggs and 234 more. How many?", "answer": "1000 + 234 = 1234\n#### 1,234"},
]
MATH = [{"problem": "What is $1/2 + 0$?", "solution": "Adding zero: $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"}]
ULTRAFEEDBACK = [
    {
        "prompt": f"Name a colour, {name}.",
        "chosen": [{"role": "user", "content": f"Name a colour, {name}."}, {"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "user", "content": f"Name a colour, {name}."}, {"role": "assistant", "content": "No."}],
        "score_chosen": 8.0,
        "score_rejected": 2.0,
    }
    for name in ("Ada", "Bo", "Cy")
]


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_final_answers():
    assert gsm8k_answer("so 7\n#### 7") == "7" and gsm8k_answer("#### 1,234 ") == "1234" and gsm8k_answer("7") is None
    assert boxed_answer("$\\boxed{\\frac{1}{2}}$ or \\boxed{x^{2}}") == "x^{2}" and boxed_answer("\\boxed{1") is None


def test_gsm8k_layout_gives_prompts_with_answers_and_sft_conversations(tiny_model_dir, tmp_path, capsys):
    rows = jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    common = ["--input", rows, "--tokenizer", str(tiny_model_dir), "--validation-fraction", "0"]
    assert (
        prepare_prompts.main(
            [*common, "--out", str(tmp_path / "p"), "--prompt-column", "question"]
            + ["--fields", "answer", "--extract", "answer=gsm8k"]
        )
        == 0
    )
    table = pq.read_table(tmp_path / "p" / "prompts_train.parquet").to_pylist()
    assert [r["answer"] for r in table] == ["7", "1234"]
    assert table[0]["prompt"] == [{"role": "user", "content": GSM8K[0]["question"]}]
    sft = ["--out", str(tmp_path / "s"), "--prompt-column", "question", "--response-column", "answer"]
    assert prepare_sft.main([*common, *sft]) == 0
    conversations = pq.read_table(tmp_path / "s" / "sft_train.parquet").to_pylist()
    assert conversations[0]["messages"][-1] == {"role": "assistant", "content": GSM8K[0]["answer"]}

    # A bad mapping names the column and the columns that exist; a row with no final answer names its field.
    assert prepare_prompts.main([*common, "--out", str(tmp_path / "x"), "--prompt-column", "query"]) == 2
    assert "no column 'query' (--prompt-column); the columns here: ['answer', 'question']" in capsys.readouterr().err
    jsonl(tmp_path / "gsm8k.jsonl", [*GSM8K, {"question": "And?", "answer": "no marker"}])
    argv = [*common, "--out", str(tmp_path / "x"), "--prompt-column", "question", "--fields", "answer"]
    assert prepare_prompts.main([*argv, "--extract", "answer=gsm8k"]) == 2
    assert "gsm8k.jsonl:3: field 'answer': no gsm8k final answer in 'no marker'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        prepare_prompts.main([*argv, "--extract", "answer=latex"])
    assert usage.value.code == 2 and "KIND must be one of ['boxed', 'gsm8k']" in capsys.readouterr().err


def test_math_layout_in_a_local_datasets_directory_with_a_configuration_and_split(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "competition_math"
    (data / "algebra").mkdir(parents=True)
    jsonl(data / "algebra" / "test.jsonl", MATH)
    jsonl(data / "algebra" / "train.jsonl", [{"problem": "unused", "solution": "\\boxed{0}", "level": "Level 2"}])
    (data / "README.md").write_text(
        "---\nconfigs:\n- config_name: algebra\n  data_files:\n  - split: train\n    path: algebra/train.jsonl\n"
        "  - split: test\n    path: algebra/test.jsonl\n---\n"
    )
    argv = ["--input", str(data), "--config-name", "algebra", "--split", "test", "--tokenizer", str(tiny_model_dir)]
    argv += ["--out", str(tmp_path / "p"), "--validation-fraction", "0", "--prompt-column", "problem"]
    argv += ["--field", "answer=solution", "--fields", "answer", "--extract", "answer=boxed"]
    assert prepare_prompts.main(argv) == 0
    [row] = pq.read_table(tmp_path / "p" / "prompts_train.parquet").to_pylist()
    assert row["answer"] == "\\frac{1}{2}" and row["prompt"][0]["content"] == MATH[0]["problem"]
    argv[argv.index("algebra")] = "geometry"  # a configuration the directory does not have: exit 2, named
    assert prepare_prompts.main(argv) == 2
    assert f"{data} (configuration 'geometry', split 'test'): not readable" in capsys.readouterr().err


def test_ultrafeedback_binarized_pairs_are_read_as_they_are(tiny_model_dir, tmp_path):
    rows = jsonl(tmp_path / "ultrafeedback.jsonl", ULTRAFEEDBACK)
    argv = ["--input", rows, "--tokenizer", str(tiny_model_dir), "--out", str(tmp_path / "p")]
    assert prepare_preferences.main([*argv, "--validation-fraction", "0"]) == 0
    pairs = pq.read_table(tmp_path / "p" / "train.parquet").to_pylist()
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("Blue.", "No.")] * 3
    assert pairs[0]["prompt"] == [{"role": "user", "content": "Name a colour, Ada."}]
