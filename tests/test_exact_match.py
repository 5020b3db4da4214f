"""Greedy exact-match accuracy (engine/rewards/exact_match.py) with real tiny models: one fitted to a
worked problem scores its answer 1 and another answer 0, an untrained one scores 0, and the command
line reads a prompts parquet and prints the share."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_prep import make_tiny_model, prepare_prompts
from engine.data.chat import tokenize_pairs
from engine.rewards import exact_match

PROBLEM = "Mia has 7 apples and buys 5 more apples. How many apples does Mia have now?"
WORKED = "7 + 5 = 12\n#### 12"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def fitted_model(tmp_path):
    """A 1-layer model fitted (full-sequence loss, 200 Adam steps, a few seconds) to PROBLEM -> WORKED."""
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": PROBLEM, "response": WORKED}) + "\n")
    out = tmp_path / "fitted"
    assert make_tiny_model.main(["--text", str(text), "--out", str(out), "--num-layers", "1"]) == 0
    tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    _, [ids] = tokenize_pairs(tokenizer, [user(PROBLEM)], [WORKED])
    batch = torch.tensor([ids])
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(200):
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    return out, tokenizer, model.eval()


def test_the_greedy_answer_counts_and_another_does_not(tmp_path, tiny_model_dir, capsys):
    out, tokenizer, model = fitted_model(tmp_path)
    prompts = [user(PROBLEM), user(PROBLEM.replace("Mia", "Ava"))]
    responses = exact_match.greedy_responses(model, tokenizer, prompts, max_new_tokens=16, batch_size=2)
    assert responses[0] == WORKED  # left padding and the chat template as the trainers render it
    for model_dir, share in ((out, 0.5), (tiny_model_dir, 0.0)):  # the untrained model answers nothing
        assert exact_match.greedy_accuracy(str(model_dir), [user(PROBLEM)] * 2, ["12", 13], max_new_tokens=16) == share

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"prompt": PROBLEM, "answer": "12"}) + "\n" + json.dumps({"prompt": "Hi", "answer": "9"})
    )
    flags = ["--fields", "answer", "--validation-fraction", "1", "--tokenizer", str(out)]
    assert prepare_prompts.main(["--input", str(rows), *flags, "--out", str(tmp_path / "data")]) == 0
    capsys.readouterr()
    parquet = str(tmp_path / "data" / "prompts_validation.parquet")
    assert exact_match.main(["--model", str(out), "--prompts", parquet, "--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out == "exact match: 0.500 (1/2)\n"
    assert exact_match.main(["--model", str(out), "--prompts", parquet, "--field", "tests"]) == 2
    assert "'tests'" in capsys.readouterr().err
