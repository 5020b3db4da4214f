"""Tools in the common format, as an environment (engine/environments/environment.py): the policy writes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the format chat templates with
``tools=`` render, e.g. Qwen's and Hermes'), each call is run and its result is the observation; a
turn without a call ends the episode. A malformed call is answered with an observation saying what
is wrong, never an exception; an episode's calls and errors are its metrics.

Built-in tools: ``calculator`` (``{"expression": "12 * (3 + 4)"}``): arithmetic on numbers with
``+ - * / // % **`` and parentheses, evaluated from its syntax tree (no ``eval``); ``python``
(``{"code": "print(2 ** 10)"}``): a program run in the code sandbox (engine/rewards/sandbox.py,
refused where it cannot isolate, within :data:`PYTHON_LIMITS`), whose output is the result. Their
docstrings are in the form transformers' ``get_json_schema`` reads (an ``Args:`` section), so they can
be passed as ``tools=`` to a chat template or a trainer that renders one.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from typing import Any, ClassVar

from engine.environments.environment import Environment
from engine.rewards.sandbox import SandboxLimits, UnisolatedError, run_program

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPONENT = 64  # a ** b with |b| above it is refused: no huge numbers


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is above {MAX_EXPONENT}")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"'{ast.unparse(node)}' is not arithmetic on numbers")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression (an int where it is a whole number).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. 12 * (3 + 4)
    """
    value = _evaluate(ast.parse(expression, mode="eval").body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


PYTHON_LIMITS = SandboxLimits(cpu_s=5, wall_s=10.0, memory_mb=512, output_kb=64)
MAX_RESULT_CHARS = 2000


def python(code: str) -> str:
    """What a Python program printed, run in a sandbox; or how it failed.

    Args:
        code: the program
    """
    try:
        run = run_program(code, limits=PYTHON_LIMITS)
    except UnisolatedError:
        return "error: python: the code sandbox cannot isolate code on this machine, so this tool is off"
    if run.status != "ok":
        last = (run.stderr.strip().splitlines() or [run.status])[-1]
        return f"error: python: {run.status}: {last}"[:MAX_RESULT_CHARS]
    return run.stdout[:MAX_RESULT_CHARS].rstrip("\n")


class ToolEnvironment(Environment):
    """Runs the turn's tool calls; their results, one per line, are the observation."""

    tools: ClassVar[dict[str, Callable[..., str]]] = {"calculator": calculator, "python": python}

    def __init__(self) -> None:
        self.calls, self.errors = 0, 0

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        calls = TOOL_CALL.findall(text)
        if not calls:
            return None, None, True
        results = [self.run(call) for call in calls]
        self.calls += len(results)
        self.errors += sum(r.startswith("error: ") for r in results)
        return "\n".join(results), None, False

    def metrics(self) -> dict[str, float]:
        """``tool_calls`` and ``tool_errors`` (malformed calls, unknown tools, failed runs) of the episode."""
        return {"tool_calls": self.calls, "tool_errors": self.errors}

    def run(self, call: str) -> str:
        """One call's result, or the error the policy is shown instead."""
        try:
            request = json.loads(call)
            name, arguments = request["name"], request.get("arguments", {})
        except (ValueError, KeyError, TypeError, AttributeError):
            return f'error: not a tool call {{"name": ..., "arguments": {{...}}}}: {call.strip()[:200]}'
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return f"error: no tool {name!r}; the tools: {', '.join(sorted(self.tools))}"
        try:
            return tool(**arguments) if isinstance(arguments, dict) else tool(arguments)
        except (ValueError, TypeError, SyntaxError, ZeroDivisionError, OverflowError) as e:
            return f"error: {name}: {e}"
