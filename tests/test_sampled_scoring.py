"""The reward model reads what the policy sampled (engine/data/chat.py, engine/ppo/rewards.py): with a
template whose generation prompt and closed assistant turn differ, the sampled ids, not a re-rendering
of their decoded text."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from engine.data.chat import (
    TemplateMismatch,
    check_closings,
    closing_ids,
    prompt_ids,
    rerendering_difference,
    sampled_conversation,
    tokenize_pairs,
)
from engine.models.loading import load_value_model
from engine.ppo.inputs import Tokenizers, reward_model_inputs
from engine.ppo.rewards import RewardModelScorer, SampledResponses
from engine.rollout.sampler import Sample
from engine.run_config.rewards import RewardModelSection

# The generation prompt ends "Assistant:", a closed turn renders "Assistant: " + the content, trailing spaces trimmed.
ASYMMETRIC_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + m['content'].rstrip() + '<|im_end|>' + '\\n' }}"
    "{% else %}{{ 'User: ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
PROMPT = [{"role": "user", "content": "Tell me about the garden in Alder."}]


@pytest.fixture(scope="module")
def asymmetric(tmp_path_factory, tiny_model_dir):
    """The tiny model's tokenizer with the asymmetric template, saved and loaded back as a user's is."""
    out = tmp_path_factory.mktemp("asymmetric")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ASYMMETRIC_TEMPLATE
    tokenizer.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def test_the_reward_model_reads_the_sampled_ids(process_group, tiny_model_dir, asymmetric):
    tok = asymmetric
    closing = closing_ids(tok)
    assert closing == tok("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    prompt = prompt_ids(tok, PROMPT)
    # As an SFT model on this template samples: a leading space, the EOS; one cut short with trailing spaces.
    finished = tok(" The garden is lovely and calm.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    cut = tok(" Awful garden   ", add_special_tokens=False)["input_ids"]
    samples = [Sample(prompt, finished, [], True), Sample(prompt, cut, [], False)]
    responses = SampledResponses.decode([type("P", (), {"messages": PROMPT, "fields": {}})()] * 2, samples, tok)

    model = load_value_model(str(tiny_model_dir), ["helpful", "harmless"]).eval()
    section = RewardModelSection(path=str(tiny_model_dir), normalize=False)
    reads_ids = RewardModelScorer(
        model, tok, section, 512, policy_tokenizer=AutoTokenizer.from_pretrained(tok.name_or_path)
    )
    full, prompt_lens = reads_ids.inputs(responses)
    assert full == [prompt + finished[:-1] + closing, prompt + cut + closing] and prompt_lens == [len(prompt)] * 2
    heads = reads_ids.score(responses)  # (2, 2)
    with torch.no_grad():
        want = torch.stack([model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1] for ids in full])
    torch.testing.assert_close(heads, want, atol=1e-5, rtol=0)

    # Re-rendering the decoded text (what a reward model with another tokenizer reads) changes the ids:
    # a doubled space after "Assistant:", the trailing spaces trimmed.
    reads_text = RewardModelScorer(model, tok, section, 512)
    rerendered, _ = reads_text.inputs(responses)
    assert all(r != f for r, f in zip(rerendered, full))
    assert tok.decode(rerendered[0]).count("Assistant:  The") == 1 and tok.decode(rerendered[1]).endswith(
        "garden<|im_end|>\n"
    )
    assert not torch.allclose(reads_text.score(responses), heads)

    # What training renders is what scoring reads: a pair's full ids are prompt + its response's + the closing.
    prompt_rows, full_rows = tokenize_pairs(tok, [PROMPT], ["The garden is lovely and calm."])
    check_closings(tok, full_rows)
    assert full_rows[0] == sampled_conversation(
        prompt_rows[0], full_rows[0][len(prompt_rows[0]) : -len(closing)], closing
    )
    assert full_rows[0] == full[0]  # the SFT-shaped sample reads exactly as its training pair
    with pytest.raises(TemplateMismatch, match="closing of an assistant turn"):
        check_closings(tok, [full_rows[0][:-1]])

    # The start-up check says so; the demo's ChatML template reads the same both ways.
    difference = rerendering_difference(tok, PROMPT)
    assert difference is not None and "reads 'sistant:  The" in difference and "sampled as 'sistant: The" in difference
    lines = reward_model_inputs(Tokenizers(tok, tok, AutoTokenizer.from_pretrained(tiny_model_dir)), PROMPT)
    assert lines[0].startswith("reward_model reads the sampled token ids") and "re-rendering" in lines[0]
    assert lines[1].startswith("judge.reward_model reads the decoded text")
    demo = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert rerendering_difference(demo, PROMPT) is None
