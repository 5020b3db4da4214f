"""GKD's dataset responses (engine/ppo/dataset_responses.py): the per-iteration draw of on-policy
iterations, and a dataset response's ids against the chat template's rendering of the closed turn.
(End to end, with the iterations that take them: tests/test_distill.py.)"""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from engine.data.chat import render_conversation, render_prompt
from engine.data.errors import DataFileError
from engine.data.prompts import Prompt
from engine.ppo.dataset_responses import DatasetResponses, on_policy, response_ids

PROMPT = [{"role": "user", "content": "Tell me about the garden in Alder."}]
RESPONSE = "The garden is calm and bright, and the river is near."


def test_the_draw_is_repeatable_its_share_is_lmbda_and_1_is_always_on_policy():
    draws = [on_policy(0, i, 0.5) for i in range(4000)]
    assert draws == [on_policy(0, i, 0.5) for i in range(4000)]  # a resume draws alike
    assert draws != [on_policy(1, i, 0.5) for i in range(4000)]  # the seed changes it
    for lmbda in (0.1, 0.5, 0.8):
        share = sum(on_policy(3, i, lmbda) for i in range(4000)) / 4000
        assert share == pytest.approx(lmbda, abs=0.03)  # 4000 Bernoulli draws: sd <= 0.008
    assert all(on_policy(s, i, 1.0) for s in (0, 7) for i in range(1000))
    assert not any(on_policy(s, i, 0.0) for s in (0, 7) for i in range(1000))


def test_a_dataset_response_is_the_closed_turn_less_the_prompt_up_to_eos(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt, full = encode(render_prompt(tokenizer, PROMPT)), encode(render_conversation(tokenizer, PROMPT, RESPONSE))
    eos = tokenizer.eos_token_id
    end = full.index(eos, len(prompt)) + 1
    assert full[end:] == encode("\n")  # ChatML closes a turn with <|im_end|> and a newline; sampling stops at EOS
    got = response_ids(tokenizer, PROMPT, RESPONSE, max_new_tokens=64)
    assert got.finished and got.ids == full[len(prompt) : end] and got.ids[-1] == eos
    assert tokenizer.decode(got.ids, skip_special_tokens=True) == RESPONSE
    cut = response_ids(tokenizer, PROMPT, RESPONSE, max_new_tokens=5)
    assert not cut.finished and cut.ids == got.ids[:5]  # as generation stops at max_new_tokens

    responses = DatasetResponses("p.parquet", [Prompt(PROMPT, {"response": RESPONSE})] * 2, "response", tokenizer, 64,
                                 lmbda=0.5, seed=0)  # fmt: skip
    groups = responses.samples([prompt, prompt], [1, 0], n=3)
    assert [len(g) for g in groups] == [3, 3] and all(s.response_ids == got.ids for g in groups for s in g)
    assert all(s.prompt_ids == prompt and s.finished and math.isnan(s.logprobs[0]) for g in groups for s in g)
    with pytest.raises(DataFileError, match=r"p.parquet: prompt 1's 'response' is int, not text; distill.response"):
        DatasetResponses("p.parquet", [Prompt(PROMPT, {"response": "a"}), Prompt(PROMPT, {"response": 3})],
                         "response", tokenizer, 64, lmbda=0.5, seed=0)  # fmt: skip
