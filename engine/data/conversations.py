"""Conversations for supervised fine-tuning: token ids with a mask of the tokens the model learns.

A conversation is a message list ending with an assistant turn. The trained tokens are what
the assistant writes in every assistant turn, as the chat template closes it (``<|im_end|>``
included, so the model learns to stop): for assistant message ``i`` they are the tokens of
``messages[: i + 1]`` beyond those of ``messages[:i]`` rendered with the generation prompt.
Everything else (system, user turns, the assistant headers) is context only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedTokenizerBase

from engine.data.chat import Message
from engine.data.errors import DataFileError, read_parquet


@dataclass(frozen=True)
class Conversation:
    """Token ids of a rendered conversation; ``trained[t]`` marks the assistant's tokens."""

    input_ids: list[int]
    trained: list[bool]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return sum(self.trained)


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    return cast(str, text)  # tokenize=False: the rendered text


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Sequence[Message]], first_row: int = 0
) -> list[Conversation]:
    """Each conversation's ids and assistant-token mask, in one batched tokenizer call.

    Raises ValueError (naming the row, counted from ``first_row``) when a conversation has no
    assistant turn, or when the template does not render each turn's prefix as a prefix of the
    whole conversation (turn boundaries would then be ill-defined).
    """
    texts: list[str] = []
    turns: list[
        list[tuple[int, int]]
    ] = []  # per conversation: (index of the prefix text, of the text through the turn)
    for n, messages in enumerate(conversations):
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"row {first_row + n}: the conversation has no assistant message to train on")
        texts.append(_render(tokenizer, messages, generation_prompt=False))
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                texts += [
                    _render(tokenizer, messages[:i], generation_prompt=True),
                    _render(tokenizer, messages[: i + 1], False),
                ]
                spans.append((len(texts) - 2, len(texts) - 1))
        turns.append(spans)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]  # the template writes the special tokens
    out, first = [], 0
    for n, spans in enumerate(turns):
        ids = encoded[first]
        trained = [False] * len(ids)
        for before, through in spans:
            start, end = len(encoded[before]), len(encoded[through])
            if ids[:start] != encoded[before] or ids[:end] != encoded[through]:
                raise ValueError(
                    f"chat template of {tokenizer.name_or_path!r} does not render row {first_row + n}'s turns as "
                    "prefixes of the whole conversation; use a template without that rewriting"
                )
            trained[start:end] = [True] * (end - start)
        out.append(Conversation(ids, trained))
        first += 1 + 2 * len(spans)
    return out


def load_conversations(path: str, tokenizer: PreTrainedTokenizerBase, chunk: int = 1024) -> list[Conversation]:
    """Read and tokenize a conversations parquet (the ``messages`` column of data_prep/prepare_sft.py)."""
    rows = read_parquet(path, ("messages",), "data_prep/prepare_sft.py").column("messages").to_pylist()
    if not rows:
        raise DataFileError(f"{path}: no conversations")
    out: list[Conversation] = []
    for start in range(0, len(rows), chunk):
        try:
            out += tokenize_conversations(tokenizer, rows[start : start + chunk], first_row=start)
        except ValueError as e:
            raise DataFileError(f"{path}: {e}") from None
    return out


def conversations_that_fit(conversations: Sequence[Conversation], max_tokens: int) -> tuple[list[Conversation], int]:
    """The conversations of at most ``max_tokens`` tokens, and how many were dropped."""
    kept = [c for c in conversations if c.num_tokens <= max_tokens]
    return kept, len(conversations) - len(kept)
