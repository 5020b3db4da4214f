"""The arithmetic task: deterministic, right answers recomputed from the words, held-out problems,
demonstrations in the answer format, and the files the tiny model and the prepare scripts take."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq

from data_prep import arithmetic_task, make_tiny_model, prepare_prompts, prepare_sft

FILES = ("prompts.jsonl", "eval_prompts.jsonl", "demonstrations.jsonl")
ADDS, SUBTRACTS = r"(?:buys|finds|gets) (\d+)", r"(?:gives|loses|sells) (\d+)"


def generate(out, *extra):
    assert arithmetic_task.main(["--out", str(out), *extra]) == 0
    return {name: [json.loads(line) for line in (out / name).read_text().splitlines()] for name in FILES}


def solve(text: str) -> tuple[int, str]:
    """The answer and the arithmetic of a problem, read from its words (independently of the generator)."""
    product = re.match(r"\w+ has (\d+) \w+ with (\d+) \w+ in each\.", text)
    if product:
        total, expression = int(product[1]) * int(product[2]), f"{product[1]} * {product[2]}"
    else:
        start = re.match(r"\w+ has (\d+) ", text)[1]
        total, expression = int(start), start
    for step in re.finditer(f"{ADDS}|{SUBTRACTS}", text):
        n = int(step[1] or step[2])
        total, expression = (total + n, f"{expression} + {n}") if step[1] else (total - n, f"{expression} - {n}")
        assert total >= 0, text
    return total, expression


def test_problems_are_right_held_out_and_deterministic(tmp_path):
    extra = ("--num-train", "300", "--num-eval", "100", "--num-demonstrations", "200", "--multiplication")
    files = generate(tmp_path / "a", *extra)
    assert generate(tmp_path / "b", *extra) == files
    assert generate(tmp_path / "c", *extra, "--seed", "1") != files
    train, evaluation, demonstrations = (files[name] for name in FILES)
    assert (len(train), len(evaluation), len(demonstrations)) == (300, 100, 200)

    solved = {r["prompt"]: solve(r["prompt"]) for rows in files.values() for r in rows}
    assert all(r["answer"] == str(solved[r["prompt"]][0]) for rows in files.values() for r in rows)
    steps = [e.count(" ") // 2 for _, e in solved.values()]
    assert set(steps) == {1, 2} and any("*" in e for _, e in solved.values())  # 1-2 operations, some products
    assert all(set(r) == {"prompt", "answer"} for r in train + evaluation)

    # Held out: no problem text twice anywhere, no evaluation arithmetic in training.
    assert len(solved) == 600
    held_out = {solved[r["prompt"]][1] for r in evaluation}
    assert not held_out & {solved[r["prompt"]][1] for r in train + demonstrations}

    # Demonstrations: worked lines, then "#### n"; half of them right, the others off by 1 to 3.
    given = [int(re.fullmatch(r"(?s).*\n#### (\d+)", r["response"])[1]) for r in demonstrations]
    right = [g == int(r["answer"]) for g, r in zip(given, demonstrations)]
    assert right == [r["correct"] for r in demonstrations] and sum(right) == 100
    assert all(1 <= abs(g - int(r["answer"])) <= 3 for g, r, ok in zip(given, demonstrations, right) if not ok)
    for r, g in zip(demonstrations, given):
        *lines, _ = r["response"].split("\n")
        assert lines[-1].endswith(f"= {g}") and len(lines) == solved[r["prompt"]][1].count(" ") // 2

    # --offsets: a systematic slip, every wrong answer one too many.
    slipped = generate(tmp_path / "d", *extra, "--demonstration-accuracy", "0.25", "--offsets=1")
    given = [int(r["response"].rsplit("#### ", 1)[1]) - int(r["answer"]) for r in slipped["demonstrations.jsonl"]]
    assert sorted(set(given)) == [0, 1] and given.count(0) == 50


def test_task_to_tiny_model_to_prompt_and_sft_files(tmp_path):
    generate(tmp_path, "--num-train", "60", "--num-eval", "20", "--num-demonstrations", "80")
    model = tmp_path / "model"
    tiny = (
        "--vocab-size",
        "400",
        "--hidden-size",
        "64",
        "--num-heads",
        "2",
        "--num-kv-heads",
        "1",
        "--num-layers",
        "1",
    )
    assert make_tiny_model.main(["--text", str(tmp_path / "demonstrations.jsonl"), "--out", str(model), *tiny]) == 0

    common = ("--tokenizer", str(model), "--out", str(tmp_path / "data"))
    assert prepare_prompts.main(["--input", str(tmp_path / "prompts.jsonl"), *common, "--fields", "answer"]) == 0
    assert prepare_sft.main(["--input", str(tmp_path / "demonstrations.jsonl"), *common]) == 0
    train = pq.read_table(tmp_path / "data" / "prompts_train.parquet")
    validation = pq.read_table(tmp_path / "data" / "prompts_validation.parquet")
    assert train.schema.field("answer").type == pa.string() and len(train) + len(validation) == 60
    assert all(r["answer"] == str(solve(r["prompt"][0]["content"])[0]) for r in train.to_pylist())
    sft = json.loads((tmp_path / "data" / "sft_summary.json").read_text())
    assert sft["read"] == sft["kept"] == 80
    # The tokenizer learnt the task's words: a problem is a few tokens a word, not bytes.
    problem = train.column("prompt")[0][0]["content"].as_py()
    assert train.column("prompt_tokens")[0].as_py() < len(problem.split()) * 2 + 10
