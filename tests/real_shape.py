"""Model directories at a real architecture's shape with no weights in them: config, a tokenizer of the
real vocabulary size, and safetensors files whose headers describe every tensor while the data stays a
hole in a sparse file (no disk, no memory). What the dry run reads of a model (config, tokenizer,
weight headers) is then exactly a real checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig

from data_prep.make_tiny_model import iter_texts, pad_vocabulary, train_tokenizer

LLAMA_3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    architectures=["LlamaForCausalLM"],
    torch_dtype="bfloat16",
)


def write_hollow_safetensors(model: torch.nn.Module, path: Path) -> None:
    """``model``'s (a meta-device model) parameters as a bf16 safetensors file with no data written."""
    header, offset = {}, 0
    for name, p in model.state_dict().items():
        size = p.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(p.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + offset)


def hollow_model_dirs(root: Path, text: Path, config: LlamaConfig = LLAMA_3_8B) -> tuple[Path, Path]:
    """(a causal LM, a reward model with one head and its reward statistics) at ``config``'s shape,
    sharing a tokenizer trained on ``text`` and padded to the real vocabulary."""
    tokenizer = pad_vocabulary(train_tokenizer(iter_texts([str(text)]), 4096), config.vocab_size)
    policy, reward = root / "policy", root / "reward"
    for path, cls, extra in (
        (policy, AutoModelForCausalLM, {"architectures": ["LlamaForCausalLM"]}),
        (
            reward,
            AutoModelForTokenClassification,
            {"architectures": ["LlamaForTokenClassification"], "id2label": {0: "reward"}},
        ),
    ):
        cfg = LlamaConfig.from_dict(config.to_dict() | extra)
        cfg.save_pretrained(path)
        tokenizer.save_pretrained(path)
        with torch.device("meta"):
            model = cls.from_config(cfg)
        write_hollow_safetensors(model, path / "model.safetensors")
    (reward / "reward_stats.json").write_text(json.dumps({"mean": 0.0, "std": 1.0, "weights": {"reward": 1.0}}))
    return policy, reward
