"""Multi-turn rollouts: each sample is an episode of turns between the policy and an environment
(engine/environments/environment.py) run in reward worker processes.

Token in, token out: a turn's sampler input is the prompt's ids plus every id of the episode so far,
so each turn's input is an exact prefix of the next, and the trained sequence is exactly the ids the
sampler saw. An observation is appended as ids, rendered once through the chat template as the delta
between a closed assistant turn and the next assistant header (:class:`ObservationTemplate`): the
history is never re-rendered. Observation tokens are marked on the sample (``Sample.observations``)
and count in no loss, KL or length (engine/ppo/experience.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.data.chat import PROBE
from engine.rewards.components import ComponentScores
from engine.rewards.pool import Call, Outcome, RewardPool
from engine.rollout.sampler import EpisodeOutcome, NextTurn, Sample, Sampler, SamplingSettings
from engine.run.distributed import RankSums

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.data.prompts import Prompt
    from engine.run_config.environment import EnvironmentSection

FUNCTIONS = "engine.environments.environment"
MARKER = "OBSERVATION-7f3a9c"  # an observation's place in the rendered template


class TemplateCannotObserve(ValueError):
    """A chat template whose turns cannot be continued by ids (the message names what is wrong)."""


@dataclass(frozen=True)
class ObservationTemplate:
    """The ids around an observation's content after a sampled turn that ended with EOS: ``before``
    (the rest of the assistant turn's closing, the observation's header) and ``after`` (its closing
    and the next assistant header)."""

    before: list[int]
    after: list[int]

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, role: str) -> ObservationTemplate:
        conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PROBE}]
        text = tokenizer.apply_chat_template(
            [*conversation, {"role": role, "content": MARKER}], tokenize=False, add_generation_prompt=True
        )
        delta = str(text)[str(text).index(PROBE) + len(PROBE) :]
        if MARKER not in delta:
            raise TemplateCannotObserve(f"the chat template does not render a '{role}' message after an assistant turn")
        before, after = (tokenizer(part, add_special_tokens=False)["input_ids"] for part in delta.split(MARKER))
        if not before or before[0] != tokenizer.eos_token_id:
            raise TemplateCannotObserve(
                f"the chat template closes an assistant turn with {before[:3]}, not with the EOS token "
                f"{tokenizer.eos_token_id} the policy's turns end with"
            )
        return cls(before[1:], after)

    def ids(self, tokenizer: PreTrainedTokenizerBase, observation: str, max_tokens: int) -> list[int]:
        """The ids appended after a turn for ``observation``, its content cut to ``max_tokens``."""
        content = tokenizer(observation, add_special_tokens=False)["input_ids"][:max_tokens]
        return [*self.before, *content, *self.after]


@dataclass
class _Episode:
    """One episode under way: its prompt, the response so far and where the observations are."""

    key: str
    slot: int  # the worker holding its environment
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    observations: list[tuple[int, int]] = field(default_factory=list)
    finished: bool = False
    turns: int = 0
    reward: float | None = None
    reply: Any = None  # the environment's last reply
    metrics: dict[str, float] | None = None  # the environment's, when the episode ended
    failure: Outcome | None = None
    open: bool = False  # its environment holds it: reset, and not yet done

    def add_turn(self, sample: Sample, limit: int) -> None:
        """Append the policy's turn, cut where the response reaches ``limit`` tokens."""
        room = limit - len(self.response)
        self.response += sample.response_ids[:room]
        self.logprobs += sample.logprobs[:room]
        self.finished = sample.finished and len(sample.response_ids) <= room
        self.turns += 1

    def add_observation(self, ids: list[int]) -> None:
        self.observations.append((len(self.response), len(self.response) + len(ids)))
        self.response += ids
        self.logprobs += [0.0] * len(ids)

    def last_turn(self) -> list[int]:
        return self.response[self.observations[-1][1] if self.observations else 0 :]

    def sample(self) -> Sample:
        failure = self.failure
        outcome = EpisodeOutcome(
            self.reward,
            self.turns,
            failure.error if failure else None,
            bool(failure and failure.timed_out),
            self.metrics,
        )
        return Sample(self.prompt, self.response, self.logprobs, self.finished, self.observations, outcome)


class EpisodeRunner:
    """Samples episodes with a sampler and ``section``'s environment in ``section.workers`` processes."""

    def __init__(self, section: EnvironmentSection, tokenizer: PreTrainedTokenizerBase, import_timeout_s: float):
        self.section, self.tokenizer = section, tokenizer
        self.template = ObservationTemplate.of(tokenizer, section.observation_role)
        module = section.name.partition(":")[0]
        self.pool = RewardPool(section.workers, [module, FUNCTIONS], import_timeout_s)

    def check(self) -> str | None:
        """Before any model loads: None when the workers import the environment, else why not."""
        if failed := self.pool.warm_up():
            return f"a worker could not import {failed[0]}: {failed[1]}"
        return None

    def run(
        self,
        sampler: Sampler,
        prompts: Sequence[Prompt],
        ids: Sequence[list[int]],
        sampling: SamplingSettings,
        seed: int,
    ) -> list[list[Sample]]:
        """``sampling.n`` episodes per prompt (``ids``: the prompts' rendered ids), the draw fixed by
        ``seed``: every environment reset, then the turns as the sampler runs them
        (:meth:`engine.rollout.sampler.Sampler.sample_episodes`), each turn that ended stepped in its
        environment and continued after the observation while the episode goes on."""
        n, workers = sampling.n, len(self.pool.workers)
        rows = [prompts[k] for k in range(len(ids)) for _ in range(n)]
        episodes = [_Episode(f"{seed}:{i}", i % workers, list(ids[i // n])) for i in range(len(rows))]
        fields = [{f: row.fields[f] for f in self.section.fields} for row in rows]
        self._call(
            episodes, "reset", [[self.section.name, e.key, r.messages, f] for e, r, f in zip(episodes, rows, fields)]
        )
        for e in episodes:
            e.open = e.failure is None
        sampler.sample_episodes(ids, sampling, seed, lambda ended: self._next_turns(episodes, ended, sampling))
        left = [e for e in episodes if e.open]  # over for the policy, not for the environment: forgotten
        closed = self.pool.run(self._calls("close", [[e.key] for e in left]), [e.slot for e in left])
        for e, outcome in zip(left, closed):
            e.metrics = outcome.value  # None where the close failed: bookkeeping, not the episode's failure
        samples = [e.sample() for e in episodes]
        return [samples[k * n : (k + 1) * n] for k in range(len(ids))]

    def _next_turns(
        self, episodes: Sequence[_Episode], ended: list[tuple[int, Sample]], sampling: SamplingSettings
    ) -> list[NextTurn]:
        """The turns that ended added to their episodes and stepped in their environments: the next
        turn of each episode that goes on (its observation appended, room left for a turn)."""
        limit = sampling.max_new_tokens
        for index, sample in ended:
            episodes[index].add_turn(sample, limit)
        active = [(index, episodes[index]) for index, _ in ended if episodes[index].failure is None]
        texts = [self.tokenizer.decode(e.last_turn(), skip_special_tokens=True) for _, e in active]
        self._call([e for _, e in active], "step", [[e.key, text] for (_, e), text in zip(active, texts)])
        going = []
        for index, e in active:
            if e.failure is not None:
                continue
            observation, reward, done, e.metrics = e.reply
            e.reward = e.reward if reward is None else (e.reward or 0.0) + reward
            e.open = not done
            if done or observation is None or not e.finished or e.turns == self.section.max_turns:
                continue
            appended = self.template.ids(self.tokenizer, observation, self.section.max_observation_tokens)
            if len(e.response) + len(appended) < limit:  # room for the observation and a turn
                e.add_observation(appended)
                going.append(NextTurn(index, e.prompt + e.response, limit - len(e.response)))
        return going

    def _call(self, episodes: Sequence[_Episode], function: str, args: Sequence[list[Any]]) -> None:
        """Call ``function`` of engine/environments/environment.py for each episode, in its worker: its
        ``reply``, or its ``failure``."""
        for e, outcome in zip(episodes, self.pool.run(self._calls(function, args), [e.slot for e in episodes])):
            if outcome.error is not None:
                e.failure = outcome
            e.reply = outcome.value

    def _calls(self, function: str, args: Sequence[list[Any]]) -> list[Call]:
        name = f"{FUNCTIONS}:{function}"
        return [Call(name, a, timeout_s=self.section.timeout_s, structured=True) for a in args]

    def close(self) -> None:
        self.pool.close()


def episode_scores(samples: Sequence[Sample], fallback: float) -> ComponentScores:
    """The component ``environment``: each episode's summed rewards (0 when its environment gave none,
    ``fallback`` where it failed, counted as an error or a timeout)."""
    outcomes = [s.episode or EpisodeOutcome(None, 1) for s in samples]
    failed = [o for o in outcomes if o.error is not None]
    values = [fallback if o.error is not None else o.reward or 0.0 for o in outcomes]
    return ComponentScores(
        torch.tensor(values, dtype=torch.float32),
        errors=sum(not o.timed_out for o in failed),
        timeouts=sum(o.timed_out for o in failed),
        first_error=next((o.error for o in failed), None),
    )


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """``environment/<name>``: each metric of the environment (Environment.metrics) averaged over the
    episodes of every rank that report it. A collective: the ranks agree on the names first."""
    names: set[str] = {n for s in samples if s.episode and s.episode.metrics for n in s.episode.metrics}
    everyone: list[set[str]] = [set()] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, names)
    agreed = sorted(set().union(*everyone))
    sums = RankSums([*agreed, *(f"{n}/episodes" for n in agreed)])
    for metrics in (s.episode.metrics for s in samples if s.episode and s.episode.metrics):
        for name, value in metrics.items():
            sums.add(**{name: value, f"{name}/episodes": 1})
    total = sums.reduced()
    return {f"environment/{n}": total.mean(n, over=f"{n}/episodes") for n in agreed}
