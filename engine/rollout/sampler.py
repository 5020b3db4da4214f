"""Rollout samplers with one interface (:class:`Sampler`): a colocated vLLM engine
(engine/rollout/vllm_sampler.py), HF ``generate`` on the actor (:class:`HFSampler`: debugging, machines
without vLLM; its weights are always current), or an async rollout's generating ranks
(engine/rollout/remote.py).

All return :class:`Sample` lists; the log-probs they report are those of the distribution sampled
from (softmax of the logits / temperature, as the actor's are computed), used to measure the gap
to the actor's own recomputed log-probs (a broken sync shows up there) and for importance weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from engine.run.distributed import all_reduce

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


class EpisodeOutcome(NamedTuple):
    """How a multi-turn episode (engine/environments/episodes.py) ended."""

    reward: float | None  # the environment's rewards summed (None: it gave none, or failed)
    turns: int  # the policy's turns
    error: str | None = None  # the environment's failure (then the episode stopped there)
    timed_out: bool = False
    metrics: dict[str, float] | None = None  # the environment's counts when the episode ended (Environment.metrics)


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # sampler's log-prob of each response token (0.0 at observations)
    finished: bool  # ended with EOS rather than at max_new_tokens
    # Multi-turn: [start, end) spans of response_ids that are the environment's observations (not sampled)
    observations: list[tuple[int, int]] = field(default_factory=list)
    episode: EpisodeOutcome | None = None

    @property
    def sampled_length(self) -> int:
        """The response tokens the policy sampled: a multi-turn episode's observations out."""
        return len(self.response_ids) - sum(end - start for start, end in self.observations)

    def state(self) -> dict[str, Any]:
        """The sample as plain values (a checkpoint loads only those: engine/run/checkpoint.py)."""
        return {**asdict(self), "episode": self.episode._asdict() if self.episode else None}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Sample:
        episode = state["episode"]
        return cls(**{**state, "episode": EpisodeOutcome(**episode) if episode else None})


@dataclass(frozen=True)
class SamplingSettings:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64


class PendingSamples(Protocol):
    """A generation asked for (:meth:`Sampler.submit`)."""

    def result(self) -> tuple[list[list[Sample]], float]:
        """(samples per prompt, seconds spent generating them), waiting for them."""
        ...


@dataclass(frozen=True)
class Generated:
    """Samples generated at once (a colocated sampler's :meth:`Sampler.submit`)."""

    samples: list[list[Sample]]
    generate_s: float

    def result(self) -> tuple[list[list[Sample]], float]:
        return self.samples, self.generate_s


ActorLogprobs = Callable[[Sequence[list[int]], Sequence[int]], list[torch.Tensor]]
"""(sequences, prompt lengths) -> the actor's (R_i,) response log-probs of each, untempered."""

TURN_SEED = 1_000_003  # a turn-synchronous episode's round r samples with request_seed + r * TURN_SEED


class NextTurn(NamedTuple):
    """A turn to sample for episode ``episode``: ``ids`` (its prompt and every id so far), at most
    ``max_new_tokens`` new."""

    episode: int
    ids: list[int]
    max_new_tokens: int


NextTurns = Callable[[list[tuple[int, Sample]]], list[NextTurn]]
"""(episode, its turn that ended) for turns that ended -> the turns to sample next (multi-turn
episodes: engine/environments/episodes.py)."""


class Sampler:
    """What a PPO run samples with. A sampler in the trainer's process generates when asked and loads
    weights as it is told; the hooks below are for one that runs elsewhere (engine/rollout/remote.py)."""

    def generate(
        self, prompts: Sequence[list[int]], settings: SamplingSettings, request_seed: int
    ) -> list[list[Sample]]:
        """``settings.n`` samples per prompt; the draw depends only on ``request_seed``."""
        raise NotImplementedError

    def submit(self, prompts: Sequence[list[int]], settings: SamplingSettings, request_seed: int) -> PendingSamples:
        """Ask for :meth:`generate`'s samples (here: generated now)."""
        t0 = time.perf_counter()
        samples = self.generate(prompts, settings, request_seed)
        return Generated(samples, time.perf_counter() - t0)

    def sample_episodes(
        self, prompts: Sequence[list[int]], settings: SamplingSettings, request_seed: int, next_turns: NextTurns
    ) -> None:
        """Multi-turn episodes: ``settings.n`` first turns per prompt (episode ``k * n + j`` is prompt
        ``k``'s ``j``-th), each turn that ends handed to ``next_turns``, whose answer is sampled next,
        until it answers none. Here turn-synchronous: the first turns as one :meth:`generate` (a
        one-turn episode samples what a single-turn rollout does), then one call per round of the
        turns asked for, the ranks of the process group calling together (a sampler shared by ranks,
        or HF generate under ZeRO-3, is a collective)."""
        firsts = self.generate(prompts, settings, request_seed)
        asked = next_turns(list(enumerate(s for group in firsts for s in group)))
        round_ = 1
        while any_rank(bool(asked)):
            room = max((t.max_new_tokens for t in asked), default=1)
            turn = SamplingSettings(1, settings.temperature, settings.top_p, room)
            groups = self.generate([t.ids for t in asked], turn, request_seed + round_ * TURN_SEED)
            asked = next_turns([(t.episode, group[0]) for t, group in zip(asked, groups)])
            round_ += 1

    def sync_weights(self, engine: DeepSpeedEngine) -> None:
        """Sample from ``engine``'s model from now on (the actor after its update)."""
        raise NotImplementedError

    def loaded_with(self, engine: DeepSpeedEngine) -> Sampler:
        """A sampler of ``engine``'s model (the reference's for a held-out comparison): this one with
        its weights loaded."""
        self.sync_weights(engine)
        return self

    def after_experience(
        self, iteration: int, sequences: Sequence[list[int]], prompt_lens: Sequence[int], actor_logprobs: ActorLogprobs
    ) -> None:
        """Called once the actor has scored an iteration's samples, before it trains on them."""

    def take_metrics(self) -> dict[str, float]:
        """The sampler's own statistics since the last call (logged as ``ppo/<name>``)."""
        return {}

    def sleep(self) -> None:
        """Free the accelerator memory it holds until it next generates or loads weights."""

    def close(self) -> None:
        """Release what it holds."""


def any_rank(going: bool) -> bool:
    """Whether any rank of the process group has turns to sample (a collective)."""
    return bool(all_reduce(torch.tensor([int(going)]), op=torch.distributed.ReduceOp.MAX).item())


class HFSampler(Sampler):
    """``generate`` on the actor (a DeepSpeed engine or a plain model)."""

    def __init__(self, actor, pad_token_id: int, eos_token_id: int):
        self.actor = actor
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id

    def generate(
        self, prompts: Sequence[list[int]], settings: SamplingSettings, request_seed: int
    ) -> list[list[Sample]]:
        module = getattr(self.actor, "module", self.actor)
        zero3 = hasattr(next(module.parameters()), "ds_id")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: generation continues every row at the end
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        device = next(module.parameters()).device
        trainer_rng = torch.get_rng_state()
        torch.manual_seed(request_seed)
        try:
            out = module.generate(
                input_ids=ids.repeat_interleave(settings.n, 0).to(device),
                attention_mask=mask.repeat_interleave(settings.n, 0).to(device),
                do_sample=settings.temperature > 0,
                temperature=settings.temperature if settings.temperature > 0 else None,
                top_p=settings.top_p,
                top_k=0,  # the whole vocabulary (generation_config's default keeps the top 50)
                max_new_tokens=settings.max_new_tokens,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
                output_scores=True,  # the logits / temperature sampled from: log-probs comparable with the actor's
                return_dict_in_generate=True,
                synced_gpus=zero3 and torch.distributed.get_world_size() > 1,  # ZeRO-3: ranks step together
            )
        finally:
            torch.set_rng_state(trainer_rng)
        new = out.sequences[:, width:]
        logprobs = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, new[..., None]).squeeze(-1).cpu()
        new = new.cpu()
        samples = []
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            length = tokens.index(self.eos_token_id) + 1 if self.eos_token_id in tokens else len(tokens)
            samples.append(
                Sample(
                    prompt_ids=list(prompts[row // settings.n]),
                    response_ids=tokens[:length],
                    logprobs=logprobs[row, :length].tolist(),
                    finished=self.eos_token_id in tokens,
                )
            )
        return [samples[i * settings.n : (i + 1) * settings.n] for i in range(len(prompts))]

    def sync_weights(self, engine: DeepSpeedEngine) -> None:
        """Nothing to do: it samples from the actor itself."""

    def loaded_with(self, engine: DeepSpeedEngine) -> Sampler:
        """``generate`` on ``engine``."""
        return HFSampler(engine, self.pad_token_id, self.eos_token_id)
