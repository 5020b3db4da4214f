"""The async rollout's channel (``rollout.mode async``): trainer ranks ask, the generating ranks answer.

The launched world is split (engine/run/distributed.SplitWorld): the trainers train, the last ranks
run one vLLM engine, tensor parallel over them (engine/rollout/generation_rank.py). Each trainer
rank writes numbered requests into its own queue in the launcher's store (``req/<trainer>/<n>``):
generate these prompts with this seed, load new weights, stop. The generating ranks all read
request n of every queue, then n + 1, and run each together; the first answers each in
``resp/<trainer>/<n>``. Requests run in the order they were made, so which weights
generate which batch is fixed by the trainers' program, not by timing: a batch asked for before
the sync of version v is generated with the weights before v.

Weights travel over a gloo group of trainer rank 0 and the generating ranks, one bucket (a decoder
layer) per broadcast of its bytes, described in the store (names, dtypes, shapes, a CRC-32 of each
tensor). Each generating rank checks every tensor's CRC before its vLLM shard loads it; a mismatch
answers the request with an error naming the tensor, and the trainers stop (:class:`WeightSyncFailed`).
"""

from __future__ import annotations

import math
import pickle
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from engine.models.deepspeed_glue import release_gathered_parameters
from engine.models.hf_weights import hf_weight_buckets, ties_embeddings
from engine.rollout.sampler import ActorLogprobs, Sample, Sampler, SamplingSettings
from engine.run.distributed import SplitWorld, all_reduce

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from deepspeed import DeepSpeedEngine

SYNC_CHECK_SEQUENCES = 2  # per training rank, re-scored by vLLM (rollout.sync_check_every)
POLL = timedelta(seconds=60)  # a wait on the store is renewed until the key appears (a dead peer ends the launch)


class WeightSyncFailed(RuntimeError):
    """A generating rank did not load what the trainers sent."""


@dataclass(frozen=True)
class TensorMeta:
    name: str  # HF parameter name
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32: int  # of the tensor's bytes as sent


class RolloutLink:
    """Messages through the store and weights through a gloo broadcast; one per process."""

    def __init__(self, split: SplitWorld, timeout: timedelta = timedelta(minutes=30)):
        """Trainer rank 0 and the generating ranks meet here (each once its models are built)."""
        self.store, self.trainers = split.store, split.trainers
        self.generating = split.world - split.trainers
        self.leads = split.rank == split.trainers  # the generating rank that reads requests and answers
        self.weights_group = None
        if split.rank == 0 or split.generates():  # trainer rank 0 sends, every generating rank receives
            prefix = torch.distributed.PrefixStore("weights/", split.store)
            member = 0 if split.rank == 0 else split.rank - split.trainers + 1
            self.weights_group = torch.distributed.ProcessGroupGloo(prefix, member, 1 + self.generating, timeout)

    def put(self, key: str, message: Any) -> None:
        self.store.set(key, pickle.dumps(message))

    def read(self, key: str) -> Any:
        """The message at ``key``, waiting for it (without a deadline: a dead peer ends the launch)."""
        while True:
            try:
                self.store.wait([key], POLL)
                break
            except torch.distributed.DistStoreError:  # not there yet
                continue
        return pickle.loads(self.store.get(key))

    def take(self, key: str) -> Any:
        """The message at ``key`` (waiting for it), removed from the store."""
        message = self.read(key)
        self.store.delete_key(key)
        return message

    def take_shared(self, key: str) -> Any:
        """On the generating ranks: the message at ``key``, read by each (no collective: a rank may wait
        for the trainers for as long as they train), removed by the last to read it."""
        if self.generating == 1:
            return self.take(key)
        message = self.read(key)
        if self.store.add(f"{key}/read", 1) == self.generating:
            self.store.delete_key(key)
            self.store.delete_key(f"{key}/read")
        return message

    def broadcast(self, flat: torch.Tensor) -> None:
        """Trainer rank 0's ``flat`` (uint8) into the generating ranks'."""
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        assert self.weights_group is not None
        self.weights_group.broadcast([flat], options).wait()  # type: ignore[attr-defined]  # (missing in the stubs)

    def send_weights(self, load: int, buckets: Iterator[list[tuple[str, torch.Tensor]]], sender: bool) -> None:
        """Every trainer iterates ``buckets`` (ZeRO-3 gathers); the sender describes and broadcasts each."""
        count = 0
        for bucket in buckets:
            if sender:
                tensors = [(name, t.detach().cpu().contiguous()) for name, t in bucket]
                self.put(f"weights/{load}/{count}", [meta(name, t) for name, t in tensors])
                self.broadcast(torch.cat([as_bytes(t) for _, t in tensors]))
            count += 1
        if sender:
            self.put(f"weights/{load}/{count}", None)

    def receive_weights(self, load: int, failures: list[str]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The buckets of weight load ``load``, each checked (:func:`unpack`): after a failure (appended to
        ``failures``) the rest are received and dropped, so the sender finishes."""
        count = 0
        while (metas := self.take_shared(f"weights/{load}/{count}")) is not None:
            flat = torch.empty(sum(m.dtype.itemsize * math.prod(m.shape) for m in metas), dtype=torch.uint8)
            self.broadcast(flat)
            count += 1
            if failures:
                continue
            try:
                bucket = unpack(flat, metas)
            except WeightSyncFailed as e:
                failures.append(f"weight load {load}, bucket {count - 1}: {e}")
                continue
            yield bucket


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def meta(name: str, t: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, t.dtype, tuple(t.shape), zlib.crc32(as_bytes(t).numpy().data))


def unpack(flat: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """``flat``'s bytes as the tensors ``metas`` describe; :class:`WeightSyncFailed` naming the first
    tensor whose bytes differ from what was sent."""
    out, offset = [], 0
    for m in metas:
        size = m.dtype.itemsize * math.prod(m.shape)
        raw = flat[offset : offset + size]
        if zlib.crc32(raw.numpy().data) != m.crc32:
            raise WeightSyncFailed(f"{m.name} {list(m.shape)}: the bytes received differ from those sent (CRC-32)")
        out.append((m.name, raw.view(m.dtype).reshape(m.shape)))
        offset += size
    return out


class RemoteGeneration:
    """A generation request made; :meth:`result` waits for its samples."""

    def __init__(self, sampler: RemoteSampler, number: int):
        self.sampler, self.number = sampler, number
        self.answer: dict[str, Any] | None = None

    def result(self) -> tuple[list[list[Sample]], float]:
        """(samples per prompt, seconds the generating rank spent on them), after comparing a sync check
        asked since (answered right after these; :class:`WeightSyncFailed` leaves the samples readable)."""
        if self.answer is None:
            self.answer = self.sampler.answer(self.number)
            self.sampler.compare_sync_check()
        return self.answer["samples"], self.answer["generate_s"]


class RemoteSampler(Sampler):
    """A trainer rank's :class:`~engine.rollout.sampler.Sampler`, served by the generating ranks.

    Every ``check_every`` iterations :meth:`after_experience` has vLLM re-score a few sequences the actor
    has just scored, with the weights it holds (the actor's at that point: the requests' order); the gap is
    compared when the next samples are read (a step boundary) and above ``tolerance`` raises
    :class:`WeightSyncFailed`: a sync whose bytes arrived whole but that vLLM did not load as sent."""

    def __init__(self, link: RolloutLink, trainer_rank: int, check_every: int, tolerance: float):
        self.link, self.rank = link, trainer_rank
        self.check_every, self.tolerance = check_every, tolerance
        self.check: tuple[int, list[torch.Tensor]] | None = None  # (request, the actor's log-probs) to compare
        self.checked_gap: float | None = None  # the last check's gap, until read
        self.sent = 0  # requests made
        self.answered = 0  # answers read
        self.unclaimed: dict[int, dict[str, Any]] = {}  # generations read while waiting for a later answer
        self.loads = 0  # weight loads requested: the version a generation request is made at

    def _request(self, message: dict[str, Any]) -> int:
        self.link.put(f"req/{self.rank}/{self.sent}", message)
        self.sent += 1
        return self.sent - 1

    def answer(self, number: int) -> dict[str, Any]:
        """The answer to request ``number``, reading (and checking) those before it."""
        while self.answered <= number:
            read = self.answered
            reply = self.link.take(f"resp/{self.rank}/{read}")
            self.answered += 1  # read once: after a failed load the answers behind it stay readable
            if reply.get("error"):
                raise WeightSyncFailed(reply["error"])
            if reply["kind"] != "weights" or read == number:
                self.unclaimed[read] = reply
        return self.unclaimed.pop(number)

    def after_experience(
        self, iteration: int, sequences: Sequence[list[int]], prompt_lens: Sequence[int], actor_logprobs: ActorLogprobs
    ) -> None:
        """Every ``check_every`` iterations: ask for a sync check of the first few sequences."""
        if iteration % self.check_every == 0:
            checked = sequences[:SYNC_CHECK_SEQUENCES], prompt_lens[:SYNC_CHECK_SEQUENCES]
            with torch.no_grad():
                self.ask_sync_check(*checked, actor_logprobs(*checked))

    def take_metrics(self) -> dict[str, float]:
        """``sync_check_gap``: the last check's, once compared."""
        gap, self.checked_gap = self.checked_gap, None
        return {} if gap is None else {"sync_check_gap": gap}

    def ask_sync_check(
        self, sequences: Sequence[list[int]], prompt_lens: Sequence[int], actor_logprobs: list[torch.Tensor]
    ) -> None:
        """Ask vLLM for the response log-probs of ``sequences``, which the actor gave as ``actor_logprobs``
        ((R_i,) each) with the weights of the last sync."""
        request = {"sequences": list(sequences), "prompt_lens": list(prompt_lens)}
        self.check = (self._request({"kind": "logprobs"} | request), actor_logprobs)

    def compare_sync_check(self) -> None:
        """The mean per-token gap of the check asked, agreed over the training ranks (a collective)."""
        if self.check is None:
            return
        number, actor = self.check
        self.check = None
        scored = self.answer(number)["logprobs"]
        gaps = torch.cat([(torch.tensor(v) - a.float()).abs() for v, a in zip(scored, actor)])
        gap = all_reduce(torch.tensor([gaps.mean().item()]), op=torch.distributed.ReduceOp.MAX).item()
        self.checked_gap = gap
        if gap > self.tolerance:
            raise WeightSyncFailed(
                f"vLLM's log-probs of sequences the actor scored differ from the actor's "
                f"by {gap:.3g} per token (rollout.sync_check_tolerance {self.tolerance}): the weights arrived whole "
                "but vLLM does not compute the actor's model"
            )

    def submit(self, prompts: Sequence[list[int]], settings: SamplingSettings, request_seed: int) -> RemoteGeneration:
        """Ask for ``settings.n`` samples per prompt, generated with the weights of the last sync."""
        request = {"prompts": list(prompts), "settings": settings, "seed": request_seed, "load": self.loads}
        number = self._request({"kind": "generate"} | request)
        return RemoteGeneration(self, number)

    def generate(
        self, prompts: Sequence[list[int]], settings: SamplingSettings, request_seed: int
    ) -> list[list[Sample]]:
        return self.submit(prompts, settings, request_seed).result()[0]

    def sync_weights(self, engine: DeepSpeedEngine) -> None:
        """Send ``engine``'s model (every trainer rank calls it: ZeRO-3 gathers); vLLM loads it after the
        requests made before. Its check is read with the next answer."""
        release_gathered_parameters(engine)  # see engine/rollout/weight_sync.push_weights_to_vllm
        self.loads += 1
        self._request({"kind": "weights", "load": self.loads, "tied": ties_embeddings(engine.module)})
        self.link.send_weights(self.loads, hf_weight_buckets(engine.module), sender=self.rank == 0)

    def close(self) -> None:
        """Stop the generating rank once it has answered everything asked (it then exits)."""
        self.answer(self._request({"kind": "stop"}))
