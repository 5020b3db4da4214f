"""The score's components besides the reward model (config section ``rewards``): built-in
verifiers, reward functions and a reward server's components, each named and weighted.

Functions and verifiers run in the reward worker pool (``engine/rewards/pool.py``), never in the
trainer: a call that raises or runs past its timeout gives that response the component's
fallback value and is counted. The length penalty is computed here (it reads token counts);
the reward server is called once per batch (``engine/rewards/remote.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.rewards.pool import RewardPool
from engine.rewards.pool_components import PoolComponent, code_verifier, format_verifier, math_verifier
from engine.rewards.remote import RewardServerClient, RewardServerError, ScoreItem, bearer_token_problem
from engine.rewards.sandbox import UnisolatedError, checked_isolation
from engine.rewards.verifiers import length_penalty
from engine.run_config.rewards import RewardsSection

Messages = list[dict[str, str]]


class RewardsUnavailable(Exception):
    """The rewards cannot be computed: a broken reward function, or a reward server that stays down or
    refuses a batch (its token, its limits)."""


class RewardsConfigError(ValueError):
    """A reward function that cannot be called, or a server without a configured component (found before
    any model loads); the message names the config key."""


@dataclass(frozen=True)
class ScoringBatch:
    """Responses to score, with what the components read."""

    prompts: Sequence[Messages]
    responses: Sequence[str]
    response_tokens: Sequence[int]
    fields: Sequence[dict[str, Any]]  # each response's prompt-data row (the declared columns)


@dataclass(frozen=True)
class ComponentScores:
    """One component's values for a batch (the fallback where a call failed) and its failures."""

    values: torch.Tensor  # (B,)
    errors: int = 0
    timeouts: int = 0
    first_error: str | None = None


class RewardComponents:
    """The configured components of ``rewards``; :meth:`score` a batch, :meth:`close` at the end."""

    def __init__(self, rewards: RewardsSection, max_new_tokens: int):
        self.section, self.max_new_tokens = rewards, max_new_tokens
        self.in_pool = _pool_components(rewards)
        self.weights = rewards.weights()
        remote = rewards.remote
        self.token = os.environ.get(remote.token_env) if remote and remote.token_env else None  # checked in check()
        self.client = (
            RewardServerClient(remote.url, remote.timeout_s, remote.retries, remote.backoff_s, self.token)
            if remote
            else None
        )
        modules = [m for c in self.in_pool for m in c.modules]
        self.pool = RewardPool(rewards.workers, modules, rewards.import_timeout_s) if self.in_pool else None
        self.isolation: str | None = None  # the code sandbox's mode (with ``code``), once :meth:`check` probed it

    def check(self, key: str = "rewards") -> None:
        """Before any model loads: the code sandbox isolates the code (or ``code.allow_unisolated``
        accepts that it cannot); the workers imported every component's modules, each function takes
        its arguments; the server's token is set, the server is up, takes the token and serves the
        configured components. :class:`RewardsConfigError` naming the key (under ``key``, the
        section's dotted path) if not."""
        if self.section.code:
            try:
                self.isolation = checked_isolation(self.section.code.allow_unisolated)
            except UnisolatedError as e:
                raise RewardsConfigError(
                    f"'{key}.code.allow_unisolated' is false and {e}, or set it to true to accept that"
                ) from None
            except RuntimeError as e:  # no mode runs here at all
                raise RewardsConfigError(f"'{key}.code': {e}") from None
        if self.pool and (failed := self.pool.warm_up()):
            module, why = failed
            owner = next((c for c in self.in_pool if module in c.modules), None)
            if owner is None:  # the worker ended or hung before its first import
                raise RewardsConfigError(f"'{key}': a reward worker did not start: {why}")
            where = f"functions.{owner.name}.function" if owner.with_prompt else owner.name
            raise RewardsConfigError(f"'{key}.{where}': a reward worker could not import {module}: {why}")
        for c in self.in_pool:
            if c.with_prompt and self.pool and (error := self.pool.check(c.function, 2, list(c.fields))):
                raise RewardsConfigError(f"'{key}.functions.{c.name}.function': {error}")
        remote = self.section.remote
        if remote and self.client:
            problem = "it is not set" if self.token is None else bearer_token_problem(self.token)
            if remote.token_env and problem:
                raise RewardsConfigError(
                    f"'{key}.remote.token_env': the environment variable {remote.token_env} holds no token for "
                    f"the reward server: {problem}"
                )
            try:
                self.client.check_components(list(remote.components))
            except RewardServerError as e:
                if e.status != 401:
                    raise RewardsConfigError(f"'{key}.remote': {e}") from None
                hint = f"is {remote.token_env} the server's token?" if remote.token_env else "the server wants a token"
                raise RewardsConfigError(f"'{key}.remote.token_env': {e} ({hint})") from None

    def score(self, batch: ScoringBatch) -> dict[str, ComponentScores]:
        """Every component's values for ``batch``; :class:`RewardsUnavailable` when the server stays down."""
        n = len(batch.responses)
        scores: dict[str, ComponentScores] = {}
        if self.pool:
            rows = list(zip(batch.prompts, batch.responses, batch.fields))
            outcomes = self.pool.run([c.call(*row) for c in self.in_pool for row in rows])
            for k, c in enumerate(self.in_pool):
                mine = outcomes[k * n : (k + 1) * n]
                failed = [o for o in mine if o.value is None]
                scores[c.name] = ComponentScores(
                    torch.tensor([c.fallback if o.value is None else o.value for o in mine], dtype=torch.float32),
                    errors=sum(not o.timed_out for o in failed),
                    timeouts=sum(o.timed_out for o in failed),
                    first_error=next((o.error for o in failed), None),
                )
        if self.section.length:
            target = self.section.length.target_tokens
            values = [length_penalty(t, target, self.max_new_tokens) for t in batch.response_tokens]
            scores["length"] = ComponentScores(torch.tensor(values, dtype=torch.float32))
        if self.client:
            scores |= self._remote(batch)
        return scores

    def _remote(self, batch: ScoringBatch) -> dict[str, ComponentScores]:
        remote = self.section.remote
        assert remote is not None and self.client is not None
        items = [
            ScoreItem(prompt=list(p), response=r, fields={f: row[f] for f in remote.fields})
            for p, r, row in zip(batch.prompts, batch.responses, batch.fields)
        ]
        try:
            served = self.client.score(items)
        except RewardServerError as e:
            raise RewardsUnavailable(str(e)) from None
        absent = [c for c in remote.components if len(served.get(c) or []) != len(items)]
        if absent:  # every rank stops at the scorer's agreement (engine/ppo/rewards.py), none waits alone
            raise RewardsUnavailable(
                f"the reward server at {remote.url} answered without {len(items)} scores of component(s) {absent} "
                f"(it answered {sorted(served)})"
            )
        scores = {}
        for component in remote.components:
            values = served[component]
            missing = sum(v is None for v in values)
            scores[f"remote_{component}"] = ComponentScores(
                torch.tensor([remote.fallback if v is None else v for v in values], dtype=torch.float32),
                errors=missing,
                first_error=f"the server at {remote.url} returned null for {missing} response(s)" if missing else None,
            )
        return scores

    def close(self) -> None:
        if self.pool:
            self.pool.close()
        if self.client:
            self.client.close()


def _pool_components(rewards: RewardsSection) -> list[PoolComponent]:
    """The components that run in the reward pool, in config order: math, code, format, then functions."""
    components = []
    if rewards.math:
        components.append(math_verifier(rewards.math, rewards.timeout_s))
    if rewards.code:
        components.append(code_verifier(rewards.code))
    if rewards.format:
        components.append(format_verifier(rewards.format, rewards.timeout_s))
    for name, fn in rewards.functions.items():
        timeout = fn.timeout_s or rewards.timeout_s
        fields = {f: f for f in fn.fields}
        components.append(PoolComponent(name, fn.function, fn.weight, fn.fallback, timeout, fields, {}, True))
    return components
