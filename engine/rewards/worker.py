"""One reward worker process (``python -m engine.rewards.worker``), started by
:class:`engine.rewards.pool.RewardPool`: calls reward functions, one request at a time.

Requests and replies are JSON lines on stdin / the original stdout:

* ``{"id": k, "function": "module:function", "args": [...], "kwargs": {...}}`` -> ``{"id": k, "value": x}``, or
  ``{"id": k, "error": "<traceback>"}`` when the function raises or returns something that is not a finite number
  (with ``"structured": true``, any JSON value: an environment's reply);
* ``{"id": k, "check": "module:function", "args": n, "kwargs": [...]}`` -> ``{"id": k, "value": 0}`` when the
  function imports and accepts ``n`` positional arguments and those keywords, else the error.

Before the first request it imports the modules named on its command line (the warm-up: math-verify's
sympy, a user's module), writing ``{"importing": module}`` before each and then ``{"ready": true}``, or
``{"ready": false, "module": module, "error": "<traceback>"}`` for the first that fails.

What a function prints goes to stderr, so it cannot corrupt the replies.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

_functions: dict[str, Callable[..., Any]] = {}


def resolve(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (imported once per worker)."""
    if spec not in _functions:
        module_name, _, name = spec.partition(":")
        if not module_name or not name:
            raise ValueError(f"{spec!r} must look like 'module:function'")
        function = getattr(importlib.import_module(module_name), name, None)
        if not callable(function):
            raise ValueError(f"module {module_name!r} has no function {name!r}")
        _functions[spec] = function
    return _functions[spec]


def check(spec: str, positional: int, keywords: list[str]) -> None:
    """Raise when ``spec`` cannot be imported or called with ``positional`` arguments and ``keywords``."""
    try:
        inspect.signature(resolve(spec)).bind(*range(positional), **dict.fromkeys(keywords))
    except TypeError as e:
        raise TypeError(f"{spec} cannot be called as f({', '.join(['prompt', 'response', *keywords])}): {e}") from None


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """The reply to one request."""
    try:
        if "check" in request:
            check(request["check"], request["args"], request["kwargs"])
            return {"id": request["id"], "value": 0.0}
        value = resolve(request["function"])(*request["args"], **request["kwargs"])
        if request.get("structured"):  # an environment's reply (engine/environments/environment.py), checked there
            return {"id": request["id"], "value": value}
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise TypeError(f"returned {value!r}, not a finite number")
        return {"id": request["id"], "value": float(value)}
    except Exception:
        return {"id": request["id"], "error": traceback.format_exc(limit=-8)}


def warm_up(modules: list[str], reply: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Import ``modules`` in order, ``reply``-ing which one is next; the ready line."""
    for module in modules:
        reply({"importing": module})
        try:
            importlib.import_module(module)
        except BaseException:  # SystemExit too: a module that exits on import must not end the worker
            return {"ready": False, "module": module, "error": traceback.format_exc(limit=-8)}
    return {"ready": True}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # a function's prints, even os.write(1, ...), go to stderr: they cannot mix with the replies
    sys.stdout = sys.stderr

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")

    reply(warm_up(sys.argv[1:], reply))
    for line in sys.stdin:
        reply(answer(json.loads(line)))


if __name__ == "__main__":
    main()
