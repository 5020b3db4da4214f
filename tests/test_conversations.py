"""Conversations for SFT: row shapes, the assistant-token mask, the loss against transformers'
own, and data_prep/prepare_sft.py end to end (real HH data included)."""

from __future__ import annotations

import gzip
import json

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_prep import prepare_sft
from data_prep.conversation_rows import parse_conversation_row
from data_prep.preference_rows import DroppedRow, InvalidRow
from engine.data.conversations import load_conversations, tokenize_conversations
from engine.data.packing import pack_sequences
from engine.sft.causal_lm import token_nll

USER, ASSISTANT = "user", "assistant"


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"messages": [msg(USER, "a"), msg(ASSISTANT, "b")]}, [msg(USER, "a"), msg(ASSISTANT, "b")]),
        ({"prompt": "a", "response": "b"}, [msg(USER, "a"), msg(ASSISTANT, "b")]),
        (
            {"prompt": [msg("system", "s"), msg(USER, "a")], "completion": [msg(ASSISTANT, "b")]},
            [msg("system", "s"), msg(USER, "a"), msg(ASSISTANT, "b")],
        ),
        ({"prompt": "a", "chosen": "b", "rejected": "c"}, [msg(USER, "a"), msg(ASSISTANT, "b")]),
        (
            {"chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d", "rejected": "..."},
            [msg(USER, "a"), msg(ASSISTANT, "b"), msg(USER, "c"), msg(ASSISTANT, "d")],
        ),
        (
            {"chosen": [msg(USER, "a"), msg(ASSISTANT, "b")], "rejected": [msg(USER, "a"), msg(ASSISTANT, "c")]},
            [msg(USER, "a"), msg(ASSISTANT, "b")],
        ),
    ],
)
def test_row_shapes(row, expected):
    assert parse_conversation_row(row) == expected


@pytest.mark.parametrize(
    "row, field",
    [
        ({"messages": [msg(USER, "a")]}, "messages"),  # nothing for the assistant to learn
        ({"messages": [msg("robot", "a"), msg(ASSISTANT, "b")]}, "messages[0].role"),
        ({"prompt": "a"}, "messages"),
        ({"prompt": "a", "response": 3}, "response"),
        ([1, 2], "<row>"),
    ],
)
def test_invalid_rows_name_the_field(row, field):
    with pytest.raises(InvalidRow) as e:
        parse_conversation_row(row)
    assert e.value.field_name == field


def test_an_empty_assistant_turn_is_dropped():
    with pytest.raises(DroppedRow, match="empty_response"):
        parse_conversation_row({"messages": [msg(USER, "a"), msg(ASSISTANT, " "), msg(USER, "b"), msg(ASSISTANT, "c")]})


def test_mask_covers_every_assistant_turn_with_its_end_token(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        msg("system", "Be kind."),
        msg(USER, "Tell me about the river."),
        msg(ASSISTANT, "River calm."),
        msg(USER, "And the garden?"),
        msg(ASSISTANT, "Garden bright."),
    ]
    [conv] = tokenize_conversations(tok, [messages])
    assert (
        conv.input_ids == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    trained = tok.decode([t for t, on in zip(conv.input_ids, conv.trained) if on])
    assert trained == "River calm.<|im_end|>\nGarden bright.<|im_end|>\n"
    with pytest.raises(ValueError, match="row 3: the conversation has no assistant message"):
        tokenize_conversations(tok, [messages[:2]], first_row=3)


def test_packed_loss_equals_transformers_own_masked_loss(tiny_model_dir):
    """token_nll over a packed row == HF's cross-entropy with labels -100 outside the assistant's
    tokens, computed per conversation without packing."""
    tok, model = (
        AutoTokenizer.from_pretrained(tiny_model_dir),
        AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(),
    )
    conversations = tokenize_conversations(
        tok,
        [
            [msg(USER, "Tell me about the river in Alder."), msg(ASSISTANT, "River calm kind.")],
            [msg(USER, "a"), msg(ASSISTANT, "Bright."), msg(USER, "b"), msg(ASSISTANT, "Gentle garden.")],
        ],
    )
    with torch.no_grad():
        packed = token_nll(model, pack_sequences([c.input_ids for c in conversations], tok.pad_token_id), conversations)
        total, count = 0.0, 0
        for c in conversations:
            labels = torch.tensor([t if on else -100 for t, on in zip(c.input_ids, c.trained)])
            loss = model(input_ids=torch.tensor([c.input_ids]), labels=labels[None]).loss
            n = int((labels[1:] != -100).sum())
            total, count = total + loss.item() * n, count + n
    assert packed.numel() == count == sum(c.num_trained for c in conversations)
    assert packed.mean().item() == pytest.approx(total / count, rel=1e-5)


def run(tmp_path, inputs, tokenizer, *extra):
    args = [a for i in inputs for a in ("--input", str(i))]
    return prepare_sft.main(
        [*args, "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"), *extra]
    ), tmp_path / "out"


def test_prepare_sft_splits_by_prompt_and_the_train_script_reads_it(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"Tell me about the river in town {i % 40}.", "response": "River calm."} for i in range(200)]
    rows.append({"messages": [msg(USER, "x"), msg(ASSISTANT, "River " * 400)]})  # over --max-length
    (tmp_path / "demos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = run(
        tmp_path, [tmp_path / "demos.jsonl"], tiny_model_dir, "--validation-fraction", "0.1", "--max-length", "256"
    )
    assert code == 0
    summary = json.loads((out / "sft_summary.json").read_text())
    assert (
        summary["read"] == 201
        and summary["dropped"] == {"too_long": 1}
        and summary["train"] + summary["validation"] == 200
    )
    train, validation = (pq.read_table(out / f"sft_{s}.parquet").to_pylist() for s in ("train", "validation"))
    assert 15 <= len(validation) <= 25
    assert not {json.dumps(r["messages"][0]) for r in train} & {json.dumps(r["messages"][0]) for r in validation}
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    loaded = load_conversations(str(out / "sft_train.parquet"), tok)
    assert [c.num_tokens for c in loaded] == [r["num_tokens"] for r in train]
    assert [c.num_trained for c in loaded] == [r["trained_tokens"] for r in train]


def test_prepare_sft_refuses_a_malformed_row_by_file_and_line(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "demos.jsonl").write_text(
        json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n"
    )
    code, out = run(tmp_path, [tmp_path / "demos.jsonl"], tiny_model_dir)
    assert code == 2 and f"{tmp_path / 'demos.jsonl'}:2: field 'messages'" in capsys.readouterr().err
    assert not out.exists()


def test_real_hh_chosen_dialogues_convert_with_every_assistant_turn(tmp_path, hh_path, hh_tokenizer):
    code, out = run(tmp_path, [hh_path], hh_tokenizer, "--max-length", "100000")
    assert code == 0
    summary = json.loads((out / "sft_summary.json").read_text())
    with gzip.open(hh_path, "rt") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert summary["read"] == len(raw) == 2312
    # Chosen dialogues with an empty assistant turn are dropped; nothing else is.
    assert summary["kept"] == summary["train"] + summary["validation"] and summary["invalid"] == {}
    assert set(summary["dropped"]) <= {"empty_response"}
    rows = pq.read_table(out / "sft_train.parquet").to_pylist()
    multi = [r for r in rows if sum(m["role"] == ASSISTANT for m in r["messages"]) > 1]
    assert len(multi) > 500  # HH dialogues are mostly multi-turn; every assistant turn is trained
    assert all(r["messages"][-1]["role"] == ASSISTANT and r["trained_tokens"] < r["num_tokens"] for r in rows)
