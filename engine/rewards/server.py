"""The reference reward server: ``python -m engine.rewards.server``, protocol in engine/rewards/remote.py.

Components it serves:

* ``--reward-model DIR`` (train_rm.py's ``<run>/model``): one per head, named by ``id2label``;
  the raw head value at the last token of the conversation rendered with the response as a
  closed assistant turn -- what the trainer's in-process reward model reads (RewardScorer.score);
* ``--math-field F``: ``math``, verifiers.math_reward(response, fields[F], --math-pattern);
* ``--format-pattern R``: ``format``, verifiers.format_reward(response, R);
* ``--code-field F``: ``code``, verifiers.code_reward(response, fields[F], ...): the share of the
  row's tests the response's code passes in the sandbox (engine/rewards/sandbox.py, its default limits).

The verifiers run in ``--workers`` reward worker processes (engine/rewards/pool.py), each call
within ``--verifier-timeout`` seconds: math-verify's timeouts need a process's main thread, and
a runaway regex or parse only costs its item. An item that cannot be scored gets null.
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
from collections.abc import Iterator, Sequence
from typing import Protocol, cast

import torch
import uvicorn
from fastapi import FastAPI

from engine.data.batching import group_tokens, plan_micro_batches, prompt_groups
from engine.data.chat import tokenize_pairs
from engine.data.packing import last_token, pack_groups, packed_forward, runs_shared_prompts
from engine.models.loading import load_value_model
from engine.rewards.pool import Call, RewardPool
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
from engine.rewards.sandbox import SandboxLimits
from engine.run.launch import RunRefused
from engine.run.preflight import check_reward_model, check_weights, load_tokenizer

log = logging.getLogger("engine.rewards.server")
Scores = dict[str, list[float | None]]
MATH_REWARD, FORMAT_REWARD = "engine.rewards.verifiers:math_reward", "engine.rewards.verifiers:format_reward"
CODE_REWARD, CODE_LIMITS = "engine.rewards.verifiers:code_reward", SandboxLimits()


class Scorer(Protocol):
    """Some of the server's components: their names and every item's score under each."""

    names: list[str]

    def score(self, items: Sequence[ScoreItem]) -> Scores: ...


class RewardModelScorer:
    """A trained reward model's heads, read at each conversation's last token, in packed
    forwards of at most ``max_tokens`` tokens (a prompt's responses share it where the attention
    allows, as in the trainer)."""

    def __init__(self, path: str, device: str, dtype: torch.dtype, max_tokens: int):
        self.tokenizer = load_tokenizer(path, "--reward-model")
        check_reward_model(path, "--reward-model", normalize=False)
        check_weights(path, "--reward-model", value_head=True)
        self.model = load_value_model(path, dtype=dtype)
        self.model.to(device).eval()  # type: ignore[arg-type]  # transformers 5.19 types .to's wrapper wrongly
        labels = cast(dict[int, str], self.model.config.id2label)
        self.names = [labels[i] for i in sorted(labels)]
        self.max_tokens = max_tokens
        self.lock = threading.Lock()  # one forward at a time: requests arrive on several threads

    @torch.no_grad()
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
        rewards: list[torch.Tensor | None] = [None] * len(items)
        with self.lock:
            for indices, values in self._forwards(sequences, prompt_lens):
                for j, value in zip(indices, values):
                    rewards[scored[j]] = value
        return {name: [None if r is None else float(r[c]) for r in rewards] for c, name in enumerate(self.names)}

    def _forwards(self, sequences: list[list[int]], prompt_lens: list[int]) -> Iterator[tuple[list[int], torch.Tensor]]:
        """``(indices into sequences, (N, C) rewards)`` per packed forward."""
        if not sequences:
            return
        if runs_shared_prompts(self.model):
            groups = prompt_groups(sequences, prompt_lens, self.max_tokens)
        else:
            groups = [(0, [i]) for i in range(len(sequences))]
        for micro in plan_micro_batches(group_tokens(sequences, groups), self.max_tokens):
            chosen = [groups[g] for g in micro]
            packed = pack_groups(sequences, chosen, self.tokenizer.pad_token_id or 0)
            per_token = packed_forward(self.model, packed).float()  # (1, T, C)
            yield [i for _, members in chosen for i in members], last_token(per_token, packed)  # (N, C)


class VerifierScorer:
    """``math``, ``format`` and/or ``code``, computed in a pool of reward worker processes."""

    def __init__(self, pool: RewardPool, args: argparse.Namespace):
        self.pool, self.timeout_s = pool, args.verifier_timeout
        self.math_field, self.math_pattern, self.format_pattern = (
            args.math_field,
            args.math_pattern,
            args.format_pattern,
        )
        self.code_field = args.code_field
        self.names = [name for name, on in (("math", args.math_field), ("format", self.format_pattern)) if on]
        self.names += ["code"] if self.code_field else []
        self.lock = threading.Lock()  # the pool serves one batch at a time

    def score(self, items: Sequence[ScoreItem]) -> Scores:
        calls: dict[tuple[str, int], Call] = {}
        limits = [CODE_LIMITS.cpu_s, CODE_LIMITS.wall_s, CODE_LIMITS.memory_mb]
        for i, item in enumerate(items):
            answer = item.fields.get(self.math_field) if self.math_field else None
            if answer is not None:  # an item without the reference answer cannot be scored
                args = [item.response, answer, self.math_pattern]
                calls["math", i] = Call(MATH_REWARD, args, timeout_s=self.timeout_s)
            if self.format_pattern:
                calls["format", i] = Call(FORMAT_REWARD, [item.response, self.format_pattern], timeout_s=self.timeout_s)
            tests = item.fields.get(self.code_field) if self.code_field else None
            if tests is not None:
                calls["code", i] = Call(CODE_REWARD, [item.response, tests, *limits], timeout_s=CODE_LIMITS.wall_s + 5)
        with self.lock:
            outcomes = dict(zip(calls, self.pool.run(list(calls.values()))))
        for (name, i), outcome in outcomes.items():
            if outcome.error is not None:
                log.warning("item %d: %s failed: %s", i, name, outcome.error.strip().splitlines()[-1])
        return {
            name: [outcomes[name, i].value if (name, i) in outcomes else None for i in range(len(items))]
            for name in self.names
        }

    def warm_up(self, workers: int) -> None:
        """Import math-verify (sympy: seconds) in every worker before the first request."""
        if self.math_field:
            check = Call(MATH_REWARD, ["\\boxed{1/2}", "0.5"], timeout_s=300)
            for outcome in self.pool.run([check] * workers):
                if outcome.value != 1.0:
                    raise RuntimeError(f"the math verifier does not run in the reward workers: {outcome.error}")


def build_app(scorers: Sequence[Scorer]) -> FastAPI:
    """The protocol's endpoints over ``scorers``, whose component names must not clash."""
    components = [name for scorer in scorers for name in scorer.names]
    if len(set(components)) != len(components):
        raise ValueError(f"component names clash: {components}")
    app = FastAPI(title="reward server", version=str(PROTOCOL_VERSION))

    @app.get(HEALTH_PATH)
    def health() -> HealthResponse:
        return HealthResponse(status="ok", protocol=PROTOCOL_VERSION)

    @app.get(COMPONENTS_PATH)
    def list_components() -> ComponentsResponse:
        return ComponentsResponse(components=components)

    @app.post(SCORE_PATH)
    def score(request: ScoreRequest) -> ScoreResponse:  # a plain def: FastAPI runs it on a worker thread
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
    parser.add_argument("--host", default="127.0.0.1")
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
    parser.add_argument("--verifier-timeout", type=float, default=10.0, help="seconds per verifier call")
    args = parser.parse_args(argv)
    if not (args.reward_model or args.math_field or args.format_pattern or args.code_field):
        parser.error("nothing to serve: give --reward-model, --math-field, --format-pattern and/or --code-field")
    for flag in ("math_pattern", "format_pattern"):
        try:
            re.compile(getattr(args, flag))
        except re.error as e:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)!r} is not a regular expression: {e}")
    if args.workers < 1 or args.max_tokens < 1:
        parser.error(f"--workers ({args.workers}) and --max-tokens ({args.max_tokens}) must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    pool = RewardPool(args.workers) if args.math_field or args.format_pattern or args.code_field else None
    try:
        scorers: list[Scorer] = []
        try:
            if args.reward_model:
                dtype = getattr(torch, args.dtype)
                scorers.append(RewardModelScorer(args.reward_model, args.device, dtype, args.max_tokens))
            if pool is not None:
                verifiers = VerifierScorer(pool, args)
                verifiers.warm_up(args.workers)
                scorers.append(verifiers)
            app = build_app(scorers)
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
