"""The model math of one PPO iteration alone: plain transformers models, no DeepSpeed, no sampling.

    python bench/model_math.py --actor DIR --reward DIR --prompts PARQUET [--batches 4] [--samples-per-prompt K]

For batches of 16 prompts (their real token counts) with K responses of 64 tokens each, times what
any PPO trainer must compute per iteration: the experience forwards (actor and reference
log-probs, critic values, reward) and one optimizer step each for actor and critic (forward,
backward, AdamW), with the same packed layout and response-only LM head that train_ppo.py uses.
Prints JSON: seconds per iteration for each part (mean over the batches after the first, a
warm-up: the prompts of iterations 2.. of a run that reads the file in order).
bench/ppo_vs_trl.py adds the sampling time to bound the speed-up over TRL any trainer could reach.
"""

from __future__ import annotations

import engine.run.cpu_threads  # noqa: F401 -- first: the training scripts' OpenMP settings

# isort: split

import argparse
import json
import statistics
import time

import pyarrow.parquet as pq
import torch

from engine.data.packing import pack_sequences, packed_forward
from engine.data.response_tokens import response_logprobs
from engine.models.loading import load_causal_lm, load_value_model

PROMPTS_PER_ITERATION, NEW_TOKENS = 16, 64


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actor", required=True)
    parser.add_argument("--reward", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    actor, ref = load_causal_lm(args.actor), load_causal_lm(args.actor)
    critic, reward = load_value_model(args.reward), load_value_model(args.reward)
    actor_opt, critic_opt = torch.optim.AdamW(actor.parameters()), torch.optim.AdamW(critic.parameters())
    lengths = pq.read_table(args.prompts, columns=["prompt_tokens"]).column(0).to_pylist()
    vocab = actor.config.vocab_size

    def experience(packed, prompt_lens):
        with torch.no_grad():
            response_logprobs(actor, packed, prompt_lens), response_logprobs(ref, packed, prompt_lens)
            packed_forward(critic, packed), packed_forward(reward, packed)

    def train(packed, prompt_lens):
        logprobs, _ = response_logprobs(actor, packed, prompt_lens, with_entropy=True)
        torch.cat(logprobs).exp().sum().backward()
        actor_opt.step(), actor_opt.zero_grad()
        packed_forward(critic, packed).square().sum().backward()
        critic_opt.step(), critic_opt.zero_grad()

    times: dict[str, list[float]] = {"experience_s": [], "train_s": []}
    for b in range(args.batches + 1):  # batch 0 warms up
        prompt_lens = [
            n
            for n in lengths[b * PROMPTS_PER_ITERATION : (b + 1) * PROMPTS_PER_ITERATION]
            for _ in range(args.samples_per_prompt)
        ]
        packed = pack_sequences([torch.randint(4, vocab, (p + NEW_TOKENS,)).tolist() for p in prompt_lens])
        for key, fn in (("experience_s", experience), ("train_s", train)):
            seconds = timed(fn, packed, prompt_lens)
            if b:
                times[key].append(seconds)
    print(json.dumps({key: statistics.mean(v) for key, v in times.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
