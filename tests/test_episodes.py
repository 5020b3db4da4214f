"""Multi-turn episodes (engine/environments/episodes.py) with the real HF sampler on the tiny model (and
colocated vLLM, which asks for each turn on its own) and environments in worker processes: token in,
token out (every turn's input a prefix of the final sequence, observations as the template's ids), a
one-turn environment samples what a single-turn rollout does, failing and hanging environments are
counted and the batch goes on; the tool environment's calls; GAE and token rewards across
observations."""

from __future__ import annotations

import json
import textwrap
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.data.chat import prompt_ids
from engine.data.prompts import Prompt
from engine.data.response_tokens import kl_penalty
from engine.environments.episodes import EpisodeRunner, episode_scores
from engine.environments.tools import ToolEnvironment
from engine.ppo.experience import Experience, sampled_token_mask
from engine.ppo.losses import aggregation_weights, gae, token_rewards
from engine.ppo.settings import PolicyLossSettings
from engine.ppo.update import actor_token_loss
from engine.rollout.sampler import HFSampler, Sample, Sampler, SamplingSettings
from engine.run_config.environment import EnvironmentSection

ENVIRONMENTS = """
import time
from engine.environments.environment import Environment

class Echo(Environment):
    def reset(self, prompt, answer):
        self.turns, self.answer = 0, answer

    def step(self, text):
        self.turns += 1
        if self.turns == 3:
            return None, 0.5, True
        return f"turn {self.turns} of {self.answer}", 0.5, False

    def metrics(self):
        return {"steps": self.turns}

class OneStep(Environment):
    def step(self, text):
        return None, None, True

class Fragile(Environment):
    def reset(self, prompt, answer):
        self.answer = answer

    def step(self, text):
        if self.answer == "raise":
            raise ValueError("a broken environment")
        if self.answer == "hang":
            time.sleep(60)
        return None, 1.0, True
"""


class RecordingSampler(HFSampler):
    """HF generate on the actor, remembering each call's inputs."""

    def __init__(self, *args):
        super().__init__(*args)
        self.inputs: list[list[int]] = []

    def generate(self, prompts, settings, request_seed):
        self.inputs += [list(p) for p in prompts]
        return super().generate(prompts, settings, request_seed)


@pytest.fixture
def policy(process_group, tiny_model_dir, tmp_path, monkeypatch):
    """The tiny model with its EOS logit raised (turns of a few tokens), and the environments' module."""
    (tmp_path / "my_env.py").write_text(textwrap.dedent(ENVIRONMENTS))
    monkeypatch.chdir(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    bias = torch.zeros(model.config.vocab_size)
    bias[tokenizer.eos_token_id] = 6.0
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    return tokenizer, RecordingSampler(model, tokenizer.pad_token_id, tokenizer.eos_token_id)


def prompts(answers: list[str]) -> list[Prompt]:
    return [Prompt([{"role": "user", "content": f"Question {a}?"}], {"answer": a}) for a in answers]


def test_episodes_continue_by_ids_and_a_one_turn_environment_samples_a_single_turn_rollout(policy):
    tokenizer, sampler = policy
    rows = prompts(["alder", "birch", "cedar"])
    ids = [prompt_ids(tokenizer, p.messages) for p in rows]
    settings = SamplingSettings(n=2, temperature=1.0, max_new_tokens=40)
    section = EnvironmentSection(name="my_env:Echo", fields=["answer"], max_turns=3, max_observation_tokens=3)
    runner = EpisodeRunner(section, tokenizer, import_timeout_s=60)
    try:
        assert runner.check() is None
        groups = runner.run(sampler, rows, ids, settings, seed=7)
    finally:
        runner.close()
    samples = [s for group in groups for s in group]
    assert [len(g) for g in groups] == [2, 2, 2] and all(s.prompt_ids == ids[i // 2] for i, s in enumerate(samples))
    full = [s.prompt_ids + s.response_ids for s in samples]
    assert all(any(f[: len(x)] == x for f in full) for x in sampler.inputs)  # each turn's input: a prefix
    assert len(sampler.inputs) == 3 + sum(s.episode.turns - 1 for s in samples)  # the prompts, then a turn each
    assert max(s.episode.turns for s in samples) == 3, [s.episode for s in samples]
    for i, s in enumerate(samples):
        assert s.episode.reward == 0.5 * s.episode.turns and len(s.observations) == s.episode.turns - 1
        assert s.episode.metrics == {"steps": s.episode.turns}  # read at the end: done, or closed
        assert len(s.response_ids) == len(s.logprobs) <= 40
        for k, (start, end) in enumerate(s.observations):
            # the template's ids for the observation, its content cut to 3 tokens, after a turn ending with EOS
            content = tokenizer(f"turn {k + 1} of {rows[i // 2].fields['answer']}", add_special_tokens=False)
            assert s.response_ids[start:end] == runner.template.ids(
                tokenizer, tokenizer.decode(content["input_ids"]), 3
            )
            assert s.response_ids[start - 1] == tokenizer.eos_token_id and s.logprobs[start:end] == [0.0] * (
                end - start
            )
            text = tokenizer.decode(s.response_ids[start - 1 : end])  # EOS, the tool message, the assistant header
            assert text == tokenizer.apply_chat_template(
                [
                    {
                        "role": "tool",
                        "content": tokenizer.decode(
                            s.response_ids[start:end][len(runner.template.before) : -len(runner.template.after)]
                        ),
                    }
                ],
                tokenize=False,
                add_generation_prompt=True,
            ).join(["<|im_end|>\n", ""])
    mask = sampled_token_mask(samples, max(len(s.response_ids) for s in samples))
    assert mask.sum().item() == sum(len(s.response_ids) - sum(e - b for b, e in s.observations) for s in samples)
    assert mask.sum(1).tolist() == [s.sampled_length for s in samples]  # the length metrics' and penalty's count

    one_step = EpisodeRunner(EnvironmentSection(name="my_env:OneStep"), tokenizer, import_timeout_s=60)
    try:
        episodes = one_step.run(sampler, rows, ids, settings, seed=7)
    finally:
        one_step.close()
    single = sampler.generate(ids, settings, 7)
    for got, want in zip((s for g in episodes for s in g), (s for g in single for s in g)):
        assert (got.response_ids, got.logprobs, got.finished, got.observations) == (
            want.response_ids,
            want.logprobs,
            want.finished,
            [],
        )
        assert got.episode.turns == 1 and got.episode.reward is None


def test_vllm_asks_for_each_turn_when_the_one_before_ends(process_group, sft_run, tmp_path, monkeypatch):
    """One vLLM engine of its own (no tensor parallelism) samples an episode's next turn while the others'
    turns are generated: greedy, every episode equals the turn-synchronous one's; a one-turn environment
    samples what a single-turn rollout does; sampled, each turn's input is a prefix of the final
    sequence, the log-probs are vLLM's and the draw follows the seed."""
    from engine.rollout.vllm_sampler import VLLMSampler

    (tmp_path / "my_env.py").write_text(textwrap.dedent(ENVIRONMENTS))
    monkeypatch.chdir(tmp_path)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    model = sft_run[0] / "run" / "model"
    tokenizer = AutoTokenizer.from_pretrained(model)
    sampler = VLLMSampler(str(model), 0, "float32", 256, tokenizer.eos_token_id, 16 << 20)
    rows = prompts(["alder", "birch", "cedar", "dogwood"])
    ids = [prompt_ids(tokenizer, p.messages) for p in rows]
    section = EnvironmentSection(name="my_env:Echo", fields=["answer"], max_turns=3, max_observation_tokens=3)
    runner = EpisodeRunner(section, tokenizer, import_timeout_s=60)
    try:
        greedy = SamplingSettings(n=1, temperature=0.0, max_new_tokens=48)
        streamed = [s for g in runner.run(sampler, rows, ids, greedy, seed=5) for s in g]
        with monkeypatch.context() as m:
            m.setattr(VLLMSampler, "sample_episodes", Sampler.sample_episodes)
            synchronous = [s for g in runner.run(sampler, rows, ids, greedy, seed=5) for s in g]
        sampled = SamplingSettings(n=3, temperature=1.0, max_new_tokens=48)
        one_step = EpisodeRunner(EnvironmentSection(name="my_env:OneStep"), tokenizer, import_timeout_s=60)
        try:
            single_turn = [s for g in one_step.run(sampler, rows, ids, sampled, seed=9) for s in g]
        finally:
            one_step.close()
        rollout = [s for g in sampler.generate(ids, sampled, 9) for s in g]
        inputs: list[list[int]] = []
        step = sampler.llm.llm_engine.add_request
        monkeypatch.setattr(
            sampler.llm.llm_engine,
            "add_request",
            lambda r, p, *a: inputs.append(p["prompt_token_ids"]) or step(r, p, *a),
        )
        first, again = (runner.run(sampler, rows, ids, sampled, seed=9) for _ in range(2))
    finally:
        runner.close()
        sampler.close()
    assert [(s.response_ids, s.observations, s.finished, s.episode) for s in streamed] == [
        (s.response_ids, s.observations, s.finished, s.episode) for s in synchronous
    ]
    assert max(s.episode.turns for s in streamed) == 3
    for a, b in zip(streamed, synchronous):  # other batches: the same log-probs to rounding
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert [(s.response_ids, s.logprobs, s.finished) for s in single_turn] == [
        (s.response_ids, s.logprobs, s.finished) for s in rollout
    ]  # a one-turn environment samples what a single-turn rollout does
    samples = [s for g in first for s in g]
    assert [[s.response_ids for s in g] for g in first] == [[s.response_ids for s in g] for g in again]
    assert len(inputs) == 2 * sum(s.episode.turns for s in samples) and max(s.episode.turns for s in samples) > 1
    full = [s.prompt_ids + s.response_ids for s in samples]
    assert all(any(f[: len(x)] == x for f in full) for x in inputs)  # each turn's input: a prefix
    for s in samples:
        sampled_at = [i for i in range(len(s.response_ids)) if not any(b <= i < e for b, e in s.observations)]
        assert sum(s.logprobs[i] for i in sampled_at) < 0 and len(s.observations) == s.episode.turns - 1
        assert all(s.logprobs[i] == 0 for b, e in s.observations for i in range(b, e))


def test_failing_and_hanging_environments_are_counted_and_the_batch_goes_on(policy):
    tokenizer, sampler = policy
    rows = prompts(["ok", "raise", "hang", "ok"])
    ids = [prompt_ids(tokenizer, p.messages) for p in rows]
    section = EnvironmentSection(name="my_env:Fragile", fields=["answer"], timeout_s=1.0, fallback=-1.0)
    runner = EpisodeRunner(section, tokenizer, import_timeout_s=60)
    start = time.monotonic()
    try:
        samples = [g[0] for g in runner.run(sampler, rows, ids, SamplingSettings(max_new_tokens=8), seed=3)]
    finally:
        runner.close()
    assert time.monotonic() - start < 20
    scores = episode_scores(samples, section.fallback)
    assert scores.values.tolist() == [1.0, -1.0, -1.0, 1.0] and (scores.errors, scores.timeouts) == (1, 1)
    assert "a broken environment" in scores.first_error


def test_tool_calls_are_run_and_malformed_ones_answered():
    tools = ToolEnvironment()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    assert tools.step("so " + call % "12 * (3 + 4)" + " and " + call % "7 / 2") == ("84\n3.5", None, False)
    assert tools.step("The answer is 84.") == (None, None, True)
    observation, _, done = tools.step(
        "<tool_call>{oops</tool_call>" + '<tool_call>{"name": "search"}</tool_call>' + call % "__import__('os')"
    )
    assert not done and observation.splitlines() == [
        'error: not a tool call {"name": ..., "arguments": {...}}: {oops',
        "error: no tool 'search'; the tools: calculator, python",
        "error: calculator: '__import__('os')' is not arithmetic on numbers",
    ]
    assert tools.step(call % "2 ** 1000")[0] == "error: calculator: exponent 1000 is above 64"
    program = '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>'
    observation, _, _ = tools.step(program % json.dumps("print(6 * 7)") + program % json.dumps("print(1 / 0)"))
    assert observation.splitlines() == ["42", "error: python: error: ZeroDivisionError: division by zero"]
    assert tools.metrics() == {"tool_calls": 8, "tool_errors": 5}


def test_gae_and_token_rewards_step_over_observations():
    """A response with an observation in the middle: its advantages equal those of the sampled tokens
    alone (the value bootstrapped across the observation as one step), the score on the last sampled token."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0]], dtype=torch.bool)  # an observation at 2..3, padding at 7
    rewards, values = torch.randn(1, 8) * mask, torch.randn(1, 8)
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    sampled = mask[0]
    alone, alone_returns = gae(rewards[:, sampled], values[:, sampled], torch.ones(1, 5, dtype=torch.bool), 0.9, 0.8)
    torch.testing.assert_close(advantages[:, sampled], alone)
    torch.testing.assert_close(returns[:, sampled], alone_returns)
    assert advantages[0, ~sampled].abs().sum() == 0
    placed = token_rewards(torch.tensor([2.0]), torch.zeros(1, 8), mask, kl_coef=0.1)
    assert placed.tolist() == [[0, 0, 0, 0, 0, 0, 2.0, 0]]


def test_changing_the_observations_leaves_the_policy_loss_and_kl_unchanged():
    """Two episodes with observations: the token-mean actor loss (clipped surrogate, k3 KL loss,
    entropy bonus) and the rollout KL are equal whatever the observation tokens' log-probs, old and
    reference log-probs, advantages and entropies, and no gradient reaches the observations."""
    samples = [
        Sample([1], [5, 6, 7, 8, 9, 10], [0.0] * 6, True, [(2, 4)]),
        Sample([1], [5, 6, 7], [0.0] * 3, True, [(1, 2)]),
    ]
    mask = sampled_token_mask(samples, 6)
    assert mask.tolist() == [[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 0, 0]]
    settings = PolicyLossSettings(
        clip_low=0.2, clip_high=0.2, clip_ratio_c=None, kl_loss_coef=0.1, kl_estimator="k3", entropy_coef=0.01
    )
    weights = aggregation_weights(mask, "token_mean", 2, int(mask.sum()), 1)
    torch.manual_seed(0)
    base = [torch.randn(2, 6) for _ in range(5)]  # log-probs, old, reference, advantages, entropy

    def loss_and_kl(observations_seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(observations_seed)  # new values at the observation tokens (and the padding)
        logprobs, old, ref, advantages, entropy = (torch.where(mask, t, torch.randn(2, 6) * 5) for t in base)
        logprobs.requires_grad_(True)
        zeros = torch.zeros(2, 6)
        mb = Experience(
            [[1] * 7, [1] * 4], [1, 1], mask, old, ref, zeros, advantages, zeros, torch.zeros(2), zeros,
            mask.float(), zeros,
        )  # fmt: skip
        loss = (actor_token_loss(logprobs, entropy, mb, settings).per_token * weights).sum()
        loss.backward()
        return loss.detach(), logprobs.grad, (kl_penalty(old, ref, "k1") * mask).sum()

    loss, grad, kl = loss_and_kl(1)
    other_loss, other_grad, other_kl = loss_and_kl(2)
    assert loss == other_loss and kl == other_kl and torch.equal(grad, other_grad)
    assert grad[~mask].abs().sum() == 0 and grad[mask].abs().min() > 0
