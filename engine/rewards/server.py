"""The reference reward server: ``python -m engine.rewards.server``, protocol in engine/rewards/remote.py.

Components it serves:

* ``--reward-model DIR`` (train_rm.py's ``<run>/model``): one per head, named by ``id2label``;
  the raw head value at the last token of the conversation rendered with the response as a
  closed assistant turn, read as the trainer's in-process reward model reads it
  (engine/rewards/reward_model.py);
* ``--math-field F``: ``math``, verifiers.math_reward(response, fields[F], --math-pattern);
* ``--format-pattern R``: ``format``, verifiers.format_reward(response, R);
* ``--code-field F``: ``code``, verifiers.code_reward(response, fields[F], ...): the share of the
  row's tests the response's code passes in the sandbox (engine/rewards/sandbox.py) within
  ``--code-cpu-s``, ``--code-wall-s`` and ``--code-memory-mb`` (the defaults of ``rewards.code``);
  refused where the sandbox cannot create namespaces unless ``--allow-unisolated`` (as
  ``rewards.code.allow_unisolated``). The sandbox's isolation is logged at start.

The verifiers are the trainer's (engine/rewards/pool_components.py), run in ``--workers`` reward
worker processes (engine/rewards/pool.py), each call within ``--verifier-timeout`` seconds (code:
``--code-wall-s`` + 5): math-verify's timeouts need a process's main thread, and a runaway regex
or parse only costs its item. An item that cannot be scored gets null.

Requests need the server's token and stay within its limits (engine/rewards/server_access.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import re
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Protocol

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from engine.data.chat import tokenize_pairs
from engine.models.loading import load_value_model
from engine.rewards.pool import Call, RewardPool
from engine.rewards.pool_components import PoolComponent, code_verifier, format_verifier, math_verifier
from engine.rewards.remote import (
    COMPONENTS_PATH,
    HEALTH_PATH,
    PROTOCOL_VERSION,
    SCORE_PATH,
    ComponentsResponse,
    HealthResponse,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
)
from engine.rewards.reward_model import head_names, reward_model_heads
from engine.rewards.sandbox import UnisolatedError, checked_isolation, describe_isolation
from engine.rewards.server_access import TOKEN_ENV, Admission, Limits, check_items, is_loopback, read_token
from engine.run.launch import RunRefused
from engine.run.preflight import check_reward_model, check_weights, load_tokenizer
from engine.run_config.rewards import CodeReward, FormatReward, MathReward

log = logging.getLogger("engine.rewards.server")
Scores = dict[str, list[float | None]]
CODE_LIMITS = ("cpu_s", "wall_s", "memory_mb")  # rewards.code's sandbox limits, each a --code-* flag


class Scorer(Protocol):
    """Some of the server's components: their names and every item's score under each."""

    names: list[str]

    def score(self, items: Sequence[ScoreItem]) -> Scores: ...


class ServerRewardModel:
    """A trained reward model's heads, read at each conversation's last token, in packed
    forwards of at most ``max_tokens`` tokens (a prompt's responses share it where the attention
    allows, as in the trainer)."""

    def __init__(self, path: str, device: str, dtype: torch.dtype, max_tokens: int):
        self.tokenizer = load_tokenizer(path, "--reward-model")
        check_reward_model(path, "--reward-model", normalize=False)
        check_weights(path, "--reward-model", value_head=True)
        self.model = load_value_model(path, dtype=dtype)
        self.model.to(device).eval()  # type: ignore[arg-type]  # transformers 5.19 types .to's wrapper wrongly
        self.names = head_names(self.model)
        self.max_tokens = max_tokens
        self.lock = threading.Lock()  # one forward at a time: requests arrive on several threads

    def score(self, items: Sequence[ScoreItem]) -> Scores:
        sequences: list[list[int]] = []
        prompt_lens: list[int] = []
        scored: list[int] = []  # the items that tokenized and fit a forward
        for i, item in enumerate(items):
            try:
                prompt_ids, full_ids = tokenize_pairs(self.tokenizer, [item.prompt], [item.response])
            except Exception as e:  # a template that refuses the roles, a prefix mismatch
                log.warning("item %d not scored by the reward model: %s", i, e)
                continue
            if len(full_ids[0]) > self.max_tokens:
                log.warning("item %d not scored: %d tokens > --max-tokens %d", i, len(full_ids[0]), self.max_tokens)
                continue
            sequences.append(full_ids[0])
            prompt_lens.append(len(prompt_ids[0]))
            scored.append(i)
        with self.lock:
            heads = reward_model_heads(self.model, sequences, prompt_lens, self.max_tokens, share_prompts=True)
        rewards: list[torch.Tensor | None] = [None] * len(items)
        for i, values in zip(scored, heads):
            rewards[i] = values
        return {name: [None if r is None else float(r[c]) for r in rewards] for c, name in enumerate(self.names)}


class VerifierScorer:
    """``math``, ``format`` and/or ``code``, computed in a pool of reward worker processes."""

    def __init__(self, pool: RewardPool, verifiers: Sequence[PoolComponent]):
        self.pool, self.verifiers = pool, list(verifiers)
        self.names = [v.name for v in self.verifiers]
        self.lock = threading.Lock()  # the pool serves one batch at a time

    def score(self, items: Sequence[ScoreItem]) -> Scores:
        calls: dict[tuple[str, int], Call] = {}
        for i, item in enumerate(items):
            for v in self.verifiers:  # an item without a verifier's field (the answer, the tests) cannot be scored
                if all(item.fields.get(column) is not None for column in v.fields.values()):
                    calls[v.name, i] = v.call(item.prompt, item.response, item.fields)
        with self.lock:
            outcomes = dict(zip(calls, self.pool.run(list(calls.values()))))
        for (name, i), outcome in outcomes.items():
            if outcome.error is not None:
                log.warning("item %d: %s failed: %s", i, name, outcome.error.strip().splitlines()[-1])
        return {
            name: [outcomes[name, i].value if (name, i) in outcomes else None for i in range(len(items))]
            for name in self.names
        }


def verifiers(args: argparse.Namespace) -> list[PoolComponent]:
    """The verifiers the flags ask for, in the order served: math, format, code."""
    served = []
    if args.math_field:
        section = MathReward(field=args.math_field, pattern=args.math_pattern)
        served.append(math_verifier(section, args.verifier_timeout))
    if args.format_pattern:
        served.append(format_verifier(FormatReward(pattern=args.format_pattern), args.verifier_timeout))
    if args.code_field:
        served.append(code_verifier(code_section(args)))
    return served


def code_section(args: argparse.Namespace) -> CodeReward:
    """``rewards.code`` as the flags give it: --code-field, the --code-* limits (ValidationError out of
    range) and --allow-unisolated."""
    limits = {limit: getattr(args, f"code_{limit}") for limit in CODE_LIMITS}
    return CodeReward(field=args.code_field, allow_unisolated=args.allow_unisolated, **limits)


def check_sandbox(allow_unisolated: bool) -> None:
    """Log the code sandbox's isolation (a warning without namespaces); :class:`UnisolatedError` naming
    --allow-unisolated where it cannot create namespaces and the flag is not given."""
    try:
        mode = checked_isolation(allow_unisolated)
    except UnisolatedError as e:
        raise UnisolatedError(f"--allow-unisolated is not given and {e}, or give it to accept that") from None
    (log.warning if mode == "none" else log.info)(describe_isolation(mode))


def build_app(scorers: Sequence[Scorer], token: str | None = None, limits: Limits | None = None) -> FastAPI:
    """The protocol's endpoints over ``scorers``, whose component names must not clash, for requests
    with ``token`` (None: any) within ``limits`` (None: the defaults)."""
    limits = limits or Limits()
    components = [name for scorer in scorers for name in scorer.names]
    if len(set(components)) != len(components):
        raise ValueError(f"component names clash: {components}")
    app = FastAPI(title="reward server", version=str(PROTOCOL_VERSION))
    app.add_middleware(Admission, token=token, limits=limits)

    @app.get(HEALTH_PATH)
    def health() -> HealthResponse:
        return HealthResponse(status="ok", protocol=PROTOCOL_VERSION)

    @app.get(COMPONENTS_PATH)
    def list_components() -> ComponentsResponse:
        return ComponentsResponse(components=components)

    @app.post(SCORE_PATH)
    def score(request: ScoreRequest) -> ScoreResponse:  # a plain def: FastAPI runs it on a worker thread
        check_items(request.items, limits)
        scores: Scores = {}
        for scorer in scorers:
            scores.update(scorer.score(request.items))
        # JSON has no NaN: a head that overflowed could not score its item
        return ScoreResponse(
            scores={k: [v if v is not None and math.isfinite(v) else None for v in vs] for k, vs in scores.items()}
        )

    return app


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, printing one line once it listens (with the port it got, for ``--port 0``)."""

    def __init__(self, config: uvicorn.Config, components: list[str]):
        super().__init__(config)
        self.components = components

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1]
            print(f"reward server: http://{self.config.host}:{port}, components {self.components}", flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.rewards.server", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="an address other than loopback needs a token")
    parser.add_argument(
        "--token-file", default="", help=f"file holding the token requests must send (default: ${TOKEN_ENV} if set)"
    )
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (the ready line names it)")
    parser.add_argument("--reward-model", default="", help="train_rm.py's <run>/model: one component per head")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens per reward-model forward")
    parser.add_argument("--math-field", default="", help="the row field with the reference answer: component math")
    parser.add_argument("--math-pattern", default="", help="regex whose first group is the final answer")
    parser.add_argument("--format-pattern", default="", help="regex a response must contain: component format")
    parser.add_argument("--code-field", default="", help="the row field with the tests: component code (sandboxed)")
    parser.add_argument("--workers", type=int, default=2, help="reward worker processes for the verifiers")
    parser.add_argument("--verifier-timeout", type=float, default=10.0, help="seconds per verifier call (not code's)")
    parser.add_argument("--max-items", type=int, default=Limits.max_items, help="items per request")
    parser.add_argument("--max-chars", type=int, default=Limits.max_chars, help="characters per response and prompt")
    parser.add_argument("--max-body-mb", type=float, default=Limits.max_body_mb, help="size of a request's body")
    for limit in CODE_LIMITS:
        field = CodeReward.model_fields[limit]
        parser.add_argument(
            f"--code-{limit.replace('_', '-')}",
            type=type(field.default),
            default=field.default,
            help=f"{field.description} (as rewards.code.{limit}; default %(default)s)",
        )
    parser.add_argument(
        "--allow-unisolated",
        action="store_true",
        help=f"{CodeReward.model_fields['allow_unisolated'].description} (as rewards.code.allow_unisolated)",
    )
    args = parser.parse_args(argv)
    if not (args.reward_model or args.math_field or args.format_pattern or args.code_field):
        parser.error("nothing to serve: give --reward-model, --math-field, --format-pattern and/or --code-field")
    for flag in ("math_pattern", "format_pattern"):
        try:
            re.compile(getattr(args, flag))
        except re.error as e:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)!r} is not a regular expression: {e}")
    for flag in ("workers", "max_tokens", "max_items", "max_chars"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if not 0 < args.max_body_mb < math.inf:
        parser.error(f"--max-body-mb {args.max_body_mb}: must be a size more than 0")
    try:
        args.token = read_token(args.token_file)
    except ValueError as e:
        parser.error(str(e))
    if args.token is None and not is_loopback(args.host):
        parser.error(
            f"--host {args.host} is not a loopback address: anyone who reaches it could use it (and run code in "
            f"its sandbox); give the token requests must send with --token-file or {TOKEN_ENV}"
        )
    try:
        code_section(args)
    except ValidationError as e:
        error = e.errors()[0]
        limit = str(error["loc"][0])
        parser.error(f"--code-{limit.replace('_', '-')} {getattr(args, f'code_{limit}')}: {error['msg']}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    served = verifiers(args)
    pool = RewardPool(args.workers, [m for v in served for m in v.modules]) if served else None
    try:
        scorers: list[Scorer] = []
        try:
            if args.code_field:  # before the reward model loads
                check_sandbox(args.allow_unisolated)
            if args.reward_model:
                dtype = getattr(torch, args.dtype)
                scorers.append(ServerRewardModel(args.reward_model, args.device, dtype, args.max_tokens))
            if pool is not None:
                if failed := pool.warm_up():  # math-verify's sympy imported before the first request
                    raise RuntimeError(f"a reward worker could not import {failed[0]}: {failed[1]}")
                scorers.append(VerifierScorer(pool, served))
            app = build_app(scorers, args.token, Limits(args.max_items, args.max_chars, args.max_body_mb))
        except (RunRefused, OSError, ValueError, RuntimeError) as e:
            print(f"reward server: {e}", file=sys.stderr)
            return 2
        components = [name for scorer in scorers for name in scorer.names]
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it
        # found (0.55): a KeyboardInterrupt for both, so that the reward workers are closed below.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with contextlib.suppress(KeyboardInterrupt):
            AnnouncingServer(uvicorn.Config(app, args.host, args.port, log_level="warning"), components).run()
    finally:
        if pool is not None:
            pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
