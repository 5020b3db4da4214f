"""Turning (prompt messages, response) into token ids through the tokenizer's chat template.

A conversation is a list of ``{"role": ..., "content": ...}`` messages. The prompt is rendered
with ``add_generation_prompt=True`` (it ends where the assistant starts writing); the full
sequence appends the response as one assistant message. The response tokens are the full
sequence minus the prompt prefix, so the reward is read at the last token of the assistant
turn as the template closes it (e.g. ``<|im_end|>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

Message = dict[str, str]


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[Message]) -> str:
    """The prompt as text, ending with the template's assistant header."""
    text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    return cast(str, text)  # tokenize=False: the rendered text


def render_conversation(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[Message], response: str) -> str:
    """Prompt plus the response as one closed assistant turn, as text."""
    messages = [*prompt, {"role": "assistant", "content": response}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return cast(str, text)  # tokenize=False: the rendered text


def tokenize_pairs(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[Message]],
    responses: Sequence[str],
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of each prompt and of each prompt + response, in one batched tokenizer call.

    Returns ``(prompt_ids, full_ids)`` with ``full_ids[i][:len(prompt_ids[i])] == prompt_ids[i]``.
    Raises ValueError when the template does not render the prompt as a prefix of the full
    conversation (such templates would make "response tokens" ill-defined).
    """
    prompt_texts = [render_prompt(tokenizer, p) for p in prompts]
    full_texts = [render_conversation(tokenizer, p, r) for p, r in zip(prompts, responses)]
    # The template already writes every special token it wants (BOS included).
    encoded = tokenizer(prompt_texts + full_texts, add_special_tokens=False)["input_ids"]
    prompt_ids, full_ids = encoded[: len(prompt_texts)], encoded[len(prompt_texts) :]
    for i, (p, f) in enumerate(zip(prompt_ids, full_ids)):
        if f[: len(p)] != p:
            raise ValueError(
                f"chat template of {tokenizer.name_or_path!r} does not render conversation {i}'s "
                "prompt as a prefix of prompt + response; use a template without that rewriting"
            )
    return prompt_ids, full_ids


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[Message]) -> list[int]:
    """Token ids of the prompt as the policy sees it (ending with the assistant header)."""
    return tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
