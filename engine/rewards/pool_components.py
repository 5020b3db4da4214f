"""Components computed in the reward pool (engine/rewards/pool.py): how one is called for a response,
and the built-in verifiers (engine/rewards/verifiers.py) made from their config sections, with
their settings and timeouts. One definition for the trainer's ``rewards`` (engine/rewards/components.py)
and the reward server's flags (engine/rewards/server.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.rewards.pool import Call
from engine.run_config.rewards import CodeReward, FormatReward, MathReward

VERIFIERS = "engine.rewards.verifiers"


@dataclass(frozen=True)
class PoolComponent:
    """A component computed by calling ``function`` in the pool, once per response."""

    name: str
    function: str  # "module:function"
    weight: float
    fallback: float
    timeout_s: float
    fields: dict[str, str]  # keyword argument -> prompt-data column
    options: dict[str, Any]  # further keyword arguments (a built-in's settings)
    with_prompt: bool  # f(prompt, response, ...) (a user's function) or f(response, ...) (a built-in)
    warm: tuple[str, ...] = ()  # modules its calls import late and slowly

    @property
    def modules(self) -> list[str]:
        """What a reward worker imports when it starts, for this component: the function's module and ``warm``."""
        return [self.function.partition(":")[0], *self.warm]

    def call(self, prompt: Sequence[dict[str, str]], response: str, row: dict[str, Any]) -> Call:
        """The call for ``response`` to ``prompt`` (chat messages), ``row`` its prompt-data row."""
        args = [list(prompt), response] if self.with_prompt else [response]
        kwargs = {arg: row[column] for arg, column in self.fields.items()} | self.options
        return Call(self.function, args, kwargs, self.timeout_s)


def math_verifier(math: MathReward, timeout_s: float) -> PoolComponent:
    """``math``: the response's final answer against the row's ``math.field`` (verifiers.math_reward)."""
    return PoolComponent(
        "math",
        f"{VERIFIERS}:math_reward",
        math.weight,
        math.fallback,
        timeout_s,
        {"answer": math.field},
        {"pattern": math.pattern},
        with_prompt=False,
        warm=("math_verify",),  # sympy: seconds to import
    )


def code_verifier(code: CodeReward) -> PoolComponent:
    """``code``: the share of the row's ``code.field`` tests the response's code passes in the sandbox,
    within ``code``'s limits and isolation (verifiers.code_reward); the call's timeout is its ``wall_s`` + 5 s."""
    return PoolComponent(
        "code",
        f"{VERIFIERS}:code_reward",
        code.weight,
        code.fallback,
        code.wall_s + 5,  # the sandbox kills the code at wall_s; 5 s more for its start and end
        {"tests": code.field},
        {
            "cpu_s": code.cpu_s,
            "wall_s": code.wall_s,
            "memory_mb": code.memory_mb,
            "allow_unisolated": code.allow_unisolated,
        },
        with_prompt=False,
        warm=("engine.rewards.sandbox",),
    )


def format_verifier(format_: FormatReward, timeout_s: float) -> PoolComponent:
    """``format``: 1.0 where the response contains ``format_.pattern`` (verifiers.format_reward)."""
    return PoolComponent(
        "format",
        f"{VERIFIERS}:format_reward",
        format_.weight,
        0.0,
        timeout_s,
        {},
        {"pattern": format_.pattern},
        with_prompt=False,
    )
