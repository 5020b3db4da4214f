"""Built-in reward functions: a math answer against the row's answer, a format check, a length
penalty, unit tests run in the sandbox. Each scores one response; the reward pool runs them
(``engine/rewards/pool.py``), outside the trainer's process, with a timeout."""

from __future__ import annotations

import re

BOXED = "\\boxed{"
HASHES = re.compile(r"####\s*([^\n]+)")
INTEGER = re.compile(r"-?\d+")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces allowed), else None."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(BOXED)
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def final_answer(response: str, pattern: str = "") -> str | None:
    """The response's final answer: the first group of the last match of ``pattern`` when given, else
    the last ``\\boxed{...}``, else what follows the last ``####``; None when there is none."""
    if pattern:
        matches = list(re.finditer(pattern, response))
        return (matches[-1].group(1) if matches[-1].groups() else matches[-1].group(0)).strip() if matches else None
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    hashes = HASHES.findall(response)
    return hashes[-1].strip() if hashes else None


def math_reward(response: str, answer: object, pattern: str = "") -> float:
    """1.0 when the response's final answer (:func:`final_answer`) equals ``answer`` mathematically
    (Hugging Face's math-verify: ``1/2``, ``0.5`` and ``\\frac12`` are equal), else 0.0. Two plain
    integers are compared as integers: math-verify's verdict, without its parsing (sympy)."""
    predicted, expected = final_answer(response, pattern), str(answer).strip()
    if not predicted:
        return 0.0
    if INTEGER.fullmatch(predicted) and INTEGER.fullmatch(expected):
        return float(int(predicted) == int(expected))
    from math_verify import parse, verify  # in the reward worker only: sympy is slow to import

    gold, guess = parse(f"${answer}$"), parse(f"${predicted}$")
    return float(bool(gold) and bool(guess) and verify(gold, guess))


def format_reward(response: str, pattern: str) -> float:
    """1.0 when ``pattern`` (a Python regular expression, ``.`` matching newlines) is found in the response."""
    return float(re.search(pattern, response, re.DOTALL) is not None)


def length_penalty(response_tokens: int, target: int, limit: int) -> float:
    """0 up to ``target`` tokens, then falling linearly to -1 at ``limit`` (the response length limit)
    and staying there: the soft overlong penalty of DAPO (Yu et al., 2025, sec. 3.4)."""
    if response_tokens <= target:
        return 0.0
    return -min(1.0, (response_tokens - target) / max(limit - target, 1))


def code_reward(
    response: str, tests: object, cpu_s: int, wall_s: float, memory_mb: int, allow_unisolated: bool
) -> float:
    """The share of ``tests`` (:func:`engine.rewards.sandbox.parse_tests`) that the response's code
    passes, run in the sandbox and counted outside it. Raises rather than run it without isolation
    unless ``allow_unisolated``: this worker probes the sandbox for itself, and a probe that failed here
    (e.g. timed out on a loaded machine) must not pass unnoticed."""
    from engine.rewards.code_tests import extract_code, parse_tests
    from engine.rewards.sandbox import SandboxLimits, checked_isolation, pass_rate

    checked_isolation(allow_unisolated)
    limits = SandboxLimits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
    return pass_rate(extract_code(response), parse_tests(tests), limits)
