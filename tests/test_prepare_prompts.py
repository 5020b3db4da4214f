"""Prompt-only preparation end to end: fields kept per row with their types, the split, the counts, the refusals."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from data_prep import prepare_prompts
from engine.data.chat import prompt_ids
from engine.data.errors import DataFileError
from engine.data.prompts import load_prompts


def run(tmp_path, src, tokenizer, *extra, out="out"):
    code = prepare_prompts.main(
        ["--input", str(src), "--tokenizer", str(tokenizer), "--out", str(tmp_path / out), *extra]
    )
    return code, tmp_path / out


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(i):
    """Row ``i``: a string prompt (every third a two-message one), a string answer, tests as a list of structs."""
    prompt = f"What is {i} plus {i}?"
    if i % 3 == 0:
        prompt = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}]
    return {"prompt": prompt, "answer": str(2 * i), "tests": [{"input": str(i), "output": str(2 * i)}], "extra": i}


def test_prompts_with_their_fields_split_by_seed(tmp_path, tiny_model_dir, capsys):
    rows = [row(i) for i in range(40)]
    rows.append(row(5))  # a repeated prompt: dropped, the first kept
    rows.append({**row(99), "prompt": "word " * 200})  # over --max-prompt-tokens
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    flags = ("--fields", "answer,tests", "--validation-fraction", "0.25", "--max-prompt-tokens", "100")
    code, out = run(tmp_path, src, tiny_model_dir, *flags)
    assert code == 0
    printed = capsys.readouterr().out
    assert "duplicate_prompt" in printed and "prompt_too_long" in printed
    assert f"wrote {out}/{{prompts_train,prompts_validation}}.parquet" in printed

    train, validation = (pq.read_table(out / f"prompts_{s}.parquet") for s in ("train", "validation"))
    assert train.schema == validation.schema
    assert train.schema.names == ["source", "prompt", "prompt_tokens", "answer", "tests"]  # no undeclared 'extra'
    assert train.schema.field("answer").type == pa.string()
    assert train.schema.field("tests").type == pa.list_(pa.struct([("input", pa.string()), ("output", pa.string())]))
    assert (len(train), len(validation)) == (30, 10)  # 40 unique prompts, a quarter held out
    summary = json.loads((out / "prompts_summary.json").read_text())
    assert summary["read"] == 42 and summary["kept"] == 40 and (summary["train"], summary["validation"]) == (30, 10)
    assert summary["dropped"] == {"duplicate_prompt": 1, "prompt_too_long": 1}
    assert summary["fields"] == {"answer": "string", "tests": "list<item: struct<input: string, output: string>>"}

    # Every kept row is its input line's: prompt as messages, fields as given, tokens as the chat template counts.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    kept = train.to_pylist() + validation.to_pylist()
    assert sorted(int(r["source"].rsplit(":", 1)[1]) for r in kept) == list(range(1, 41))
    for r in kept:
        given = rows[int(r["source"].rsplit(":", 1)[1]) - 1]
        as_messages = (
            given["prompt"] if isinstance(given["prompt"], list) else [{"role": "user", "content": given["prompt"]}]
        )
        assert r["prompt"] == as_messages and r["answer"] == given["answer"] and r["tests"] == given["tests"]
        assert r["prompt_tokens"] == len(
            tok.apply_chat_template(as_messages, add_generation_prompt=True, return_dict=False)
        )
    # What PPO reads: each prompt with the columns its rewards declare; a column no file has is refused by its reader.
    read = load_prompts(
        str(out / "prompts_train.parquet"), {"answer": "rewards.math.field", "tests": "rewards.code.field"}
    )
    assert [(p.messages, p.fields) for p in read] == [
        (r["prompt"], {"answer": r["answer"], "tests": r["tests"]}) for r in train.to_pylist()
    ]
    with pytest.raises(DataFileError, match=r"missing column\(s\) \['solution'\]; rewards.functions.f.fields reads"):
        load_prompts(str(out / "prompts_train.parquet"), {"solution": "rewards.functions.f.fields"})
    assert not {json.dumps(p) for p in train.column("prompt").to_pylist()} & {
        json.dumps(p) for p in validation.column("prompt").to_pylist()
    }

    # The split is the seed's: the same seed the same files, another seed another split; 0 writes train only.
    _, again = run(tmp_path, src, tiny_model_dir, *flags, out="again")
    _, other = run(tmp_path, src, tiny_model_dir, *flags, "--seed", "1", out="other")
    assert pq.read_table(again / "prompts_validation.parquet").equals(validation)
    assert not pq.read_table(other / "prompts_validation.parquet").equals(validation)
    _, whole = run(tmp_path, src, tiny_model_dir, "--fields", "answer", "--validation-fraction", "0", out="whole")
    assert not (whole / "prompts_validation.parquet").exists()
    assert pq.read_table(whole / "prompts_train.parquet").schema.names[-1] == "answer"


def test_a_missing_field_stops_with_file_line_and_field(tmp_path, tiny_model_dir, capsys):
    src = write_jsonl(tmp_path / "rows.jsonl", [row(1), {"prompt": "p", "answer": None}, {"prompt": "q"}])
    code, out = run(tmp_path, src, tiny_model_dir, "--fields", "answer")
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert f"{src}:2: field 'answer': missing" in err and "--skip-invalid" in err and "Traceback" not in err


def test_a_field_of_mixed_types_stops_naming_the_field_and_rows(tmp_path, tiny_model_dir, capsys):
    rows = [{**row(1), "answer": 2}, {**row(2), "answer": 4}, {**row(3), "answer": "6"}]
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    code, out = run(tmp_path, src, tiny_model_dir, "--fields", "answer")
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert f"{src}:3: field 'answer': string here but int64 in {src}:1" in err


def test_skip_invalid_counts_every_reason(tmp_path, tiny_model_dir):
    rows = [
        row(1),
        "{not json",
        "[1]",
        {"answer": "1"},
        {"prompt": "p", "answer": None},
        {"prompt": [{"role": "assistant", "content": "hi"}], "answer": "1"},
        {"prompt": 7, "answer": "1"},
        {"prompt": "mixed", "answer": 1},
        {"prompt": " ", "answer": "1"},
        row(2),
    ]
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    code, out = run(tmp_path, src, tiny_model_dir, "--fields", "answer", "--skip-invalid", "--validation-fraction", "0")
    assert code == 0
    summary = json.loads((out / "prompts_summary.json").read_text())
    assert summary["read"] == 10 and summary["kept"] == summary["train"] == 2
    assert summary["invalid"] == {
        "bad_json": 1,
        "not_object": 1,
        "missing_field": 2,
        "bad_message": 1,
        "wrong_type": 1,
        "mixed_types": 1,
    }
    assert summary["dropped"] == {"empty_prompt": 1}
    assert [r["answer"] for r in pq.read_table(out / "prompts_train.parquet").to_pylist()] == ["2", "4"]


def test_an_instruction_a_system_prompt_and_tools_are_in_the_rendered_prompt(tmp_path, tiny_model_dir, capsys):
    """GSM8K's layout with verl's instruction: what the policy sees (rendered as the trainer renders the
    file, tools through the template's tools=) carries each, and the summary records them."""
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(8)]
    src = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    instruction = "Let's think step by step and output the final answer after '####'."
    flags = ["--prompt-column", "question", "--fields", "answer", "--extract", "answer=gsm8k"]
    flags += ["--prompt-template", "{question} " + instruction, "--system-prompt", "You are a careful tutor."]
    code, out = run(tmp_path, src, tiny_model_dir, *flags, "--tools", "calculator", "--validation-fraction", "0")
    assert code == 2  # the tool schema's tokens (bytes to the tiny tokenizer) exceed the default
    assert "(read 8; 8 dropped as prompt_too_long: more than --max-prompt-tokens 512 tokens" in capsys.readouterr().err
    flags += ["--max-prompt-tokens", "2048"]
    code, out = run(tmp_path, src, tiny_model_dir, *flags, "--tools", "calculator", "--validation-fraction", "0")
    assert code == 0
    summary = json.loads((out / "prompts_summary.json").read_text())
    assert summary["prompt_template"] == "{question} " + instruction
    assert summary["system_prompt"] == "You are a careful tutor." and summary["tools"] == ["calculator"]

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = load_prompts(str(out / "prompts_train.parquet"), {"answer": "rewards.math.field"})
    table = pq.read_table(out / "prompts_train.parquet").to_pylist()
    for prompt, stored in zip(prompts, table):
        ids = prompt_ids(tok, prompt.messages)
        assert len(ids) == stored["prompt_tokens"]
        text = tok.decode(ids)
        question = prompt.messages[-1]["content"].removesuffix(" " + instruction)
        assert f"user\n{question} {instruction}<|im_end|>" in text
        assert "system\nYou are a careful tutor.\n\n# Tools" in text and '"name": "calculator"' in text
        assert text.index("You are a careful tutor.") < text.index("<tools>") < text.index(question)
        assert prompt.fields["answer"] == str(2 * int(question.split()[2]))


def test_bad_prompt_options_are_refused_before_any_row_is_read(tmp_path, tiny_model_dir, capsys):
    src = write_jsonl(tmp_path / "rows.jsonl", [row(1), row(2)])
    for template, message in (
        ("{prompt", "--prompt-template: not a format string"),
        ("{0} step by step", "{0} is not a column name"),
        ("Solve it.", "--prompt-template names no field"),
    ):
        with pytest.raises(SystemExit) as exit:
            run(tmp_path, src, tiny_model_dir, "--prompt-template", template)
        assert exit.value.code == 2 and message in capsys.readouterr().err
    (tmp_path / "tools.json").write_text(json.dumps([{"type": "function", "function": {"parameters": {}}}]))
    with pytest.raises(SystemExit):
        run(tmp_path, src, tiny_model_dir, "--tools", str(tmp_path / "tools.json"))
    assert f"--tools {tmp_path / 'tools.json'}: item 0: expected" in capsys.readouterr().err

    # a field the row lacks: exit 2 at the row, naming the field and the row's columns, even with --skip-invalid
    code, out = run(tmp_path, src, tiny_model_dir, "--prompt-template", "{question} step by step", "--skip-invalid")
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert f"{src}:1: --prompt-template names 'question', which this row lacks; its columns: ['answer'," in err

    # a template that ignores tools=, and one that cannot render a system message, are refused by the flag
    plain = tmp_path / "plain"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    tok.save_pretrained(plain)
    assert run(tmp_path, src, plain, "--tools", "calculator,python")[0] == 2
    assert f"--tools: the chat template of {plain} ignores tools=" in capsys.readouterr().err
    tok.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    tok.save_pretrained(plain)
    assert run(tmp_path, src, plain, "--system-prompt", "Be brief.")[0] == 2
    assert f"--system-prompt: the chat template of {plain} cannot render it (no system role)" in capsys.readouterr().err
