"""The tests of the ``code`` reward, kept in the trainer's process: what a test case is
(:func:`parse_tests`), the code in a response (:func:`extract_code`), and how a sandboxed run's
reports are scored (:func:`score_records`, :func:`same_output`). Expected values never leave this
module for the sandbox (engine/rewards/sandbox.py), so the code cannot forge a pass."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from engine.data.errors import DataFileError


@dataclass(frozen=True)
class AssertCase:
    expr: str  # the non-literal side of the assert: all that enters the sandbox
    expected: object  # the literal side, evaluated here


@dataclass(frozen=True)
class IoCase:
    stdin: str
    stdout: str  # expected, compared here


TestCase = AssertCase | IoCase


def parse_tests(tests: object) -> list[TestCase]:
    """A row's `tests` field -> cases; ValueError naming the item (e.g. "tests[2]: ...") when malformed.
    Accepts a list, or a JSON string holding a list. Items: "assert <expr> == <literal>" strings, or
    {"input": <stdin str>, "output": <expected stdout str>} objects (a program run per case)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as e:
            raise ValueError(f"tests: not JSON ({e})") from None
    if not isinstance(tests, list):
        raise ValueError(f"tests: expected a list or a JSON string holding a list, got {type(tests).__name__}")
    if not tests:
        raise ValueError("tests: no test cases")
    return [_parse_item(item, f"tests[{i}]") for i, item in enumerate(tests)]


def _parse_item(item: object, where: str) -> TestCase:
    if isinstance(item, str):
        return _parse_assert(item, where)
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected an assert string or an input/output object, got {type(item).__name__}")
    if set(item) != {"input", "output"}:
        raise ValueError(f"{where}: expected exactly the keys 'input' and 'output', got {sorted(item)}")
    for key in ("input", "output"):
        if not isinstance(item[key], str):
            raise ValueError(f"{where}.{key}: expected a string, got {type(item[key]).__name__}")
    return IoCase(stdin=item["input"], stdout=item["output"])


def _parse_assert(text: str, where: str) -> AssertCase:
    try:
        body = ast.parse(text).body
    except SyntaxError as e:
        raise ValueError(f"{where}: not Python ({e.msg}): {text!r}") from None
    test = body[0].test if len(body) == 1 and isinstance(body[0], ast.Assert) else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        raise ValueError(f"{where}: expected 'assert <expr> == <literal>', got {text!r}")
    sides = [test.left, test.comparators[0]]
    literals = [_literal(side) for side in sides]
    if all(ok for ok, _ in literals):
        raise ValueError(f"{where}: both sides of == are literals: {text!r}")
    for (ok, value), other in zip(reversed(literals), sides):
        if ok:
            return AssertCase(expr=ast.unparse(other), expected=value)
    raise ValueError(f"{where}: neither side of == is a literal: {text!r}")


def _literal(node: ast.expr) -> tuple[bool, object]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last ```python (or bare ```) fenced block of a response, else the whole response."""
    blocks = [code for lang, code in _FENCE.findall(response) if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else response


def normalise(output: str) -> str:
    """Stripped, line ends unified, trailing spaces of each line dropped."""
    return "\n".join(line.rstrip() for line in output.strip().splitlines())


def score_records(records: bytes, cases: list[AssertCase]) -> list[bool]:
    """Per case: exactly one record with a repr equal to the expected literal. A malformed record
    (only the code can write one) voids the run; a test id reported twice earns nothing."""
    reported: dict[int, list[object]] = {}
    for line in records.split(b"\n")[:-1]:  # the part after the last newline may be cut: ignored
        try:
            test_id, text = json.loads(line)
        except (ValueError, TypeError):
            return [False] * len(cases)
        if type(test_id) is not int or not 0 <= test_id < len(cases) or not isinstance(text, str | None):
            return [False] * len(cases)
        reported.setdefault(test_id, []).append(text)
    texts = [reported.get(i, []) for i in range(len(cases))]
    return [len(t) == 1 and isinstance(t[0], str) and _matches(t[0], c.expected) for t, c in zip(texts, cases)]


def _matches(reported: str, expected: object) -> bool:
    try:
        return _same(ast.literal_eval(reported), expected)
    except Exception:  # not a literal (an object, a huge or deep repr): no credit
        return False


def _same(a: object, b: object) -> bool:
    """``a == b`` over literals with the types checked at every level, so True != 1 and "1" != 1;
    int and float compare by value (2 == 2.0), as the assert would."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def check_column(path: str, column: str, values: list[object]) -> None:
    """Every row's tests parse: a malformed one is the data's error, refused before any model loads."""
    for row, tests in enumerate(values):
        try:
            parse_tests(tests)
        except ValueError as e:
            raise DataFileError(f"{path}[row {row}]: column '{column}': {e}") from None
