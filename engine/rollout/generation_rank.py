"""The generating rank of an async rollout (``rollout.mode async``): vLLM answering the trainer ranks'
requests (engine/rollout/remote.py) in the order they were made, until told to stop.

Weight loads are counted; a generation request carries the count its trainer had sent when it
asked, and is answered only with those weights (a mismatch is a bug in the order, not a timing
effect). Nothing here is checkpointed: the trainers hold every batch not yet trained on.
"""

from __future__ import annotations

import itertools
import signal
import time
from typing import TYPE_CHECKING

from engine.rollout.remote import RolloutLink
from engine.rollout.weight_sync import load_into_vllm
from engine.run import faults

if TYPE_CHECKING:
    from engine.rollout.sampler import VLLMSampler
    from engine.run.distributed import SplitWorld


def serve(sampler: VLLMSampler, split: SplitWorld) -> int:
    """Answer the trainers until they say stop; returns the exit code (0). SIGTERM and SIGINT (which the
    launcher forwards to every rank) are the trainers' to act on: they still need this rank to finish the
    batches their checkpoint carries."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    link = RolloutLink(split)
    loads, generations = 0, 0
    for number in itertools.count():
        requests = [link.take(f"req/{t}/{number}") for t in range(split.trainers)]
        kinds = {r["kind"] for r in requests}
        if len(kinds) != 1:
            raise RuntimeError(f"request {number}: the trainer ranks asked for different things: {sorted(kinds)}")
        kind = kinds.pop()
        if kind == "generate":
            for trainer, request in enumerate(requests):
                if request["load"] != loads:
                    raise RuntimeError(f"request {number}: asked at weight load {request['load']}, served at {loads}")
                generations += 1
                faults.kill_generating_rank(generations)
                t0 = time.perf_counter()
                samples = sampler.generate(request["prompts"], request["settings"], request["seed"])
                answer = {"kind": kind, "samples": samples, "generate_s": time.perf_counter() - t0}
                link.put(f"resp/{trainer}/{number}", answer)
            continue
        if kind == "logprobs":
            for trainer, request in enumerate(requests):
                scored = sampler.response_logprobs(request["sequences"], request["prompt_lens"])
                link.put(f"resp/{trainer}/{number}", {"kind": kind, "logprobs": scored})
            continue
        error = None
        if kind == "weights":
            loads += 1
            failures: list[str] = []
            load_into_vllm(sampler.llm, link.receive_weights(loads, failures), requests[0]["tied"])
            error = failures[0] if failures else None
        for trainer in range(split.trainers):
            link.put(f"resp/{trainer}/{number}", {"kind": kind, "error": error})
        if kind == "stop":
            sampler.close()
            return 0
    raise AssertionError("unreachable")
