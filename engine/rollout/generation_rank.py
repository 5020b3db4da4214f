"""The generating ranks of an async rollout (``rollout.mode async``): one vLLM engine, tensor parallel
over them, answering the trainer ranks' requests (engine/rollout/remote.py) in the order they were
made, until told to stop. Every generating rank runs every request (vLLM's external launcher: the
ranks of an engine step together); each reads the requests, the first writes the answers.

Weight loads are counted; a generation request carries the count its trainer had sent when it
asked, and is answered only with those weights (a mismatch is a bug in the order, not a timing
effect). Nothing here is checkpointed: the trainers hold every batch not yet trained on.
"""

from __future__ import annotations

import itertools
import signal
import time
from typing import TYPE_CHECKING, Any

import torch

from engine.rollout.remote import RolloutLink
from engine.rollout.weight_sync import load_into_vllm
from engine.run import faults

if TYPE_CHECKING:
    from engine.rollout.vllm_sampler import VLLMSampler
    from engine.run.distributed import SplitWorld


def serve(sampler: VLLMSampler, split: SplitWorld) -> int:
    """Answer the trainers until they say stop; returns the exit code (0). SIGTERM and SIGINT (which the
    launcher forwards to every rank) are the trainers' to act on: they still need these ranks to finish the
    batches their checkpoint carries."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    link = RolloutLink(split)
    loads, generations = 0, 0
    for number in itertools.count():
        requests = [link.take_shared(f"req/{t}/{number}") for t in range(split.trainers)]
        kinds = {r["kind"] for r in requests}
        if len(kinds) != 1:
            raise RuntimeError(f"request {number}: the trainer ranks asked for different things: {sorted(kinds)}")
        kind = kinds.pop()
        answers: list[dict[str, Any]]
        if kind == "generate":
            answers = []
            for request in requests:
                if request["load"] != loads:
                    raise RuntimeError(f"request {number}: asked at weight load {request['load']}, served at {loads}")
                generations += 1
                faults.kill_generating_rank(generations)
                t0 = time.perf_counter()
                samples = sampler.generate(request["prompts"], request["settings"], request["seed"])
                answers.append({"kind": kind, "samples": samples, "generate_s": time.perf_counter() - t0})
        elif kind == "logprobs":
            answers = [
                {"kind": kind, "logprobs": sampler.response_logprobs(r["sequences"], r["prompt_lens"])}
                for r in requests
            ]
        else:
            error = None
            if kind == "weights":
                loads += 1
                failures: list[str] = []
                load_into_vllm(sampler.llm, link.receive_weights(loads, failures), requests[0]["tied"])
                error = first_failure(failures, link.generating)
            answers = [{"kind": kind, "error": error}] * split.trainers
        if link.leads:
            for trainer, message in enumerate(answers):
                link.put(f"resp/{trainer}/{number}", message)
        if kind == "stop":
            sampler.close()
            return 0
    raise AssertionError("unreachable")


def first_failure(failures: list[str], generating: int) -> str | None:
    """The first failed check of a weight load on any generating rank (a collective of theirs)."""
    everyone: list[list[str]] = [failures]
    if generating > 1:
        everyone = [[] for _ in range(generating)]
        torch.distributed.all_gather_object(everyone, failures)
    return next((f"generating rank {g}: {fs[0]}" for g, fs in enumerate(everyone) if fs), None)
