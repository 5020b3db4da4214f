"""GKD's dataset responses (``distill.lmbda`` < 1): which iterations sample their responses from the
actor and which take the prompt file's own (:func:`on_policy`), and those responses as the samples
a finished generation would have made (:class:`DatasetResponses`).

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes", Algorithm 1: with probability lmbda a batch's outputs are the student's samples, else the
dataset's, and the same divergence to the teacher is taken on either (TRL's ``GKDTrainer`` draws per
batch the same way). Here a batch is an iteration's rollout.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from engine.data.chat import Message, TemplateMismatch, check_closings, closing_ids, tokenize_pairs
from engine.data.errors import DataFileError
from engine.data.prompts import Prompt
from engine.rollout.sampler import Sample


def on_policy(seed: int, iteration: int, lmbda: float) -> bool:
    """Whether 0-based ``iteration`` samples its responses from the actor: true with probability
    ``lmbda``, drawn from (``seed``, ``iteration``) alone, so every rank and a resumed run draw alike."""
    return random.Random(seed * 1_000_003 + iteration).random() < lmbda


class DatasetResponse(NamedTuple):
    """A dataset response as a sampled one would be: its ids and whether it finished."""

    ids: list[int]  # the response tokens, ending with EOS unless cut at max_new_tokens
    finished: bool  # ended with EOS rather than at max_new_tokens


def response_ids(
    tokenizer: PreTrainedTokenizerBase, prompt: Sequence[Message], response: str, max_new_tokens: int
) -> DatasetResponse:
    """``response`` rendered as the chat template closes an assistant turn after ``prompt``, less the
    prompt, up to and including the closing's EOS (where a sampled response stops; the template's
    closing then EOS when it has none), cut at ``max_new_tokens`` as generation would be.
    :class:`TemplateMismatch` when the template does not render the prompt as a prefix or the closing
    last (engine/data/chat.py)."""
    [prompt_ids], [full] = tokenize_pairs(tokenizer, [prompt], [response])
    check_closings(tokenizer, [full])
    closing, eos = closing_ids(tokenizer), tokenizer.eos_token_id
    ending = closing[: closing.index(eos) + 1] if eos in closing else [*closing, eos]
    ids = full[len(prompt_ids) : len(full) - len(closing)] + ending
    return DatasetResponse(ids[:max_new_tokens], len(ids) <= max_new_tokens)


class DatasetResponses:
    """Each prompt's dataset response (the prompt file's ``field`` column), tokenised once, and the
    iterations that take them (:func:`on_policy` with ``lmbda``)."""

    def __init__(
        self,
        path: str,
        prompts: Sequence[Prompt],
        field: str,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int,
        lmbda: float,
        seed: int,
    ):
        """:class:`DataFileError` naming ``path`` and the key when a response is not text or the chat
        template cannot close it."""
        self.lmbda, self.seed, self.responses = lmbda, seed, []
        for i, prompt in enumerate(prompts):
            text = prompt.fields[field]
            if not isinstance(text, str):
                raise DataFileError(
                    f"{path}: prompt {i}'s '{field}' is {type(text).__name__}, not text; distill.response_field "
                    "reads each prompt's dataset response from it"
                )
            try:
                self.responses.append(response_ids(tokenizer, prompt.messages, text, max_new_tokens))
            except TemplateMismatch as e:
                raise DataFileError(f"{path}: prompt {i}'s '{field}' (distill.response_field): {e}") from None

    def on_policy(self, iteration: int) -> bool:
        return on_policy(self.seed, iteration, self.lmbda)

    def samples(self, prompt_ids: Sequence[list[int]], indices: Sequence[int], n: int) -> list[list[Sample]]:
        """``n`` samples per prompt (``indices`` into the prompt list, ``prompt_ids`` theirs), each its
        dataset response: an iteration keeps the rollout's shape (mini-batches, steps, groups) whichever
        its responses are. No sampler log-probs: NaN (the experience takes the actor's)."""
        responses = [self.responses[i] for i in indices]
        return [
            [Sample(list(ids), list(r.ids), [math.nan] * len(r.ids), r.finished) for _ in range(n)]
            for ids, r in zip(prompt_ids, responses)
        ]
