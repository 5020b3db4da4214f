"""Turning (prompt messages, response) into token ids through the tokenizer's chat template.

A conversation is a list of ``{"role": ..., "content": ...}`` messages. The prompt is rendered
with ``add_generation_prompt=True`` (it ends where the assistant starts writing); the full
sequence appends the response as one assistant message. The response tokens are the full
sequence minus the prompt prefix, so the reward is read at the last token of the assistant
turn as the template closes it (e.g. ``<|im_end|>``).

A prompt may carry tool schemas (OpenAI function format) as its first message, of role
:data:`TOOLS_ROLE` with the schemas' JSON list as content (data_prep/prepare_prompts.py ``--tools``
writes it): every rendering here passes them to the template as ``tools=`` instead of as a message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

Message = dict[str, str]
TOOLS_ROLE = "tools"  # not a chat role: the prepare scripts refuse it in input rows


class TemplateMismatch(ValueError):
    """A conversation the chat template renders in a way response tokens cannot be read from."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index  # the conversation's position in the batch


PROBE = "The answer is 42."  # an assistant message's content, rendered to find what the template puts around it


def tools_message(tools: Sequence[dict[str, Any]]) -> Message:
    """The first prompt message that carries ``tools`` (see the module docstring)."""
    return {"role": TOOLS_ROLE, "content": json.dumps(list(tools))}


def split_tools(prompt: Sequence[Message]) -> tuple[list[Message], list[Any] | None]:
    """The prompt's chat messages and its tool schemas (None: it carries none)."""
    if prompt and prompt[0]["role"] == TOOLS_ROLE:
        return list(prompt[1:]), json.loads(prompt[0]["content"])
    return list(prompt), None


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[Message]) -> str:
    """The prompt as text, ending with the template's assistant header."""
    messages, tools = split_tools(prompt)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return cast(str, text)  # tokenize=False: the rendered text


def render_conversation(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[Message], response: str) -> str:
    """Prompt plus the response as one closed assistant turn, as text."""
    messages, tools = split_tools(prompt)
    text = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": response}], tools=tools, tokenize=False
    )
    return cast(str, text)  # tokenize=False: the rendered text


def closing_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids the chat template writes after an assistant message's content (ChatML:
    ``<|im_end|>`` and a newline): what closes a sampled response where training closed it."""
    text = render_conversation(tokenizer, [{"role": "user", "content": "?"}], PROBE)
    return tokenizer(text[text.rindex(PROBE) + len(PROBE) :], add_special_tokens=False)["input_ids"]


def tokenize_pairs(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[Message]],
    responses: Sequence[str],
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of each prompt and of each prompt + response, in one batched tokenizer call.

    Returns ``(prompt_ids, full_ids)`` with ``full_ids[i][:len(prompt_ids[i])] == prompt_ids[i]``.
    Raises :class:`TemplateMismatch` when the template does not render the prompt as a prefix of the
    full conversation (such templates would make "response tokens" ill-defined).
    """
    prompt_texts = [render_prompt(tokenizer, p) for p in prompts]
    full_texts = [render_conversation(tokenizer, p, r) for p, r in zip(prompts, responses)]
    # The template already writes every special token it wants (BOS included).
    encoded = tokenizer(prompt_texts + full_texts, add_special_tokens=False)["input_ids"]
    prompt_ids, full_ids = encoded[: len(prompt_texts)], encoded[len(prompt_texts) :]
    for i, (p, f) in enumerate(zip(prompt_ids, full_ids)):
        if f[: len(p)] != p:
            raise TemplateMismatch(
                i,
                f"chat template of {tokenizer.name_or_path!r} does not render conversation {i}'s "
                "prompt as a prefix of prompt + response; use a template without that rewriting",
            )
    return prompt_ids, full_ids


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[Message]) -> list[int]:
    """Token ids of the prompt as the policy sees it (ending with the assistant header)."""
    return tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]


def check_closings(tokenizer: PreTrainedTokenizerBase, full_ids: Sequence[list[int]]) -> None:
    """:class:`TemplateMismatch` unless every conversation ends with the template's :func:`closing_ids`:
    what a reward model or DPO trains on is then the layout PPO scores a sampled response in
    (:func:`sampled_conversation`)."""
    closing = closing_ids(tokenizer)
    for i, ids in enumerate(full_ids):
        if ids[len(ids) - len(closing) :] != closing:
            raise TemplateMismatch(
                i,
                f"the chat template's closing of an assistant turn {closing} tokenizes into the response's last "
                f"tokens (conversation {i} ends {ids[-len(closing) - 2 :]}): a sampled response would be scored "
                "in another layout than this one trains",
            )


def sampled_conversation(prompt_ids: Sequence[int], content_ids: Sequence[int], closing: Sequence[int]) -> list[int]:
    """The ids a reward model reads of a sampled response: the prompt's as sampled, the response's
    content (:func:`content_ids`), then the template's closing (:func:`closing_ids`): the layout
    :func:`tokenize_pairs` gives its training pairs, with no re-rendering of the template around it."""
    return [*prompt_ids, *content_ids, *closing]


def content_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """Each response's decoded text encoded on its own: its sampled ids, except where the policy
    sampled a split the tokenizer never makes or a special token inside the response (decoding skips
    it); those read as the training pairs have such text."""
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []


def shares_template(policy: PreTrainedTokenizerBase, reader: PreTrainedTokenizerBase) -> bool:
    """Whether ``reader`` (a reward model's tokenizer) reads the policy's ids as they are: the same
    vocabulary and the same chat template."""
    return policy.get_vocab() == reader.get_vocab() and policy.chat_template == reader.chat_template


def rerendering_difference(tokenizer: PreTrainedTokenizerBase, prompt: Sequence[Message]) -> str | None:
    """Where decoding a sampled-shaped response and rendering it again would change its ids, or None.

    The responses tried are the assistant turn's own ids for :data:`PROBE` (as an SFT model learns to
    sample them), and the same followed by a newline; each is compared as :func:`sampled_conversation`
    reads it with the template's rendering of its decoded text."""
    prompt_len = len(tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"])
    closing = closing_ids(tokenizer)
    rendered = tokenizer(render_conversation(tokenizer, prompt, PROBE), add_special_tokens=False)["input_ids"]
    content = rendered[prompt_len : len(rendered) - len(closing)]
    prompt_ids = rendered[:prompt_len]
    for sampled in (content, content + tokenizer("\n", add_special_tokens=False)["input_ids"]):
        ids = sampled_conversation(prompt_ids, sampled, closing)
        text = str(tokenizer.decode(sampled, skip_special_tokens=True))
        again = tokenizer(render_conversation(tokenizer, prompt, text), add_special_tokens=False)["input_ids"]
        if again != ids:
            k = next((i for i, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
            return (
                f"the response {text!r} re-rendered reads {tokenizer.decode(again[max(k - 6, 0) : k + 4])!r} "
                f"where it was sampled as {tokenizer.decode(ids[max(k - 6, 0) : k + 4])!r} (token {k})"
            )
    return None
