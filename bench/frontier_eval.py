"""The frontier's measure, the same for every trainer: a policy's true score on a synthetic task (the
demo's or the list task's) and its KL per token to the SFT model, from its samples on held-out prompts.

    python bench/frontier_eval.py --policy DIR --sft DIR --prompts runs/demo/data/prompts_validation.parquet
                                  [--task demo|lists] [--samples-per-prompt 16] [--max-new-tokens 24] [--seed 0]

Each held-out prompt gets K responses (HF ``generate``, temperature 1, ended by the tokenizer's EOS
or the token limit). The true score is the task's rule (:func:`true_scorer`) on the decoded text;
no reward model is involved. The KL per token is
``sum over samples of (log pi - log pi_sft)(response) / sum of response tokens``: the Monte-Carlo
estimate of KL(pi || pi_sft) of whole responses on the policy's own samples, per token, both
log-probs from a forward of the sequence (not the sampler's). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
from frontier_tasks import TASKS

from data_prep import list_task, synthetic_task
from engine.data.chat import prompt_ids
from engine.data.prompts import load_prompts
from engine.models.loading import load_causal_lm
from engine.ppo.forwards import sequence_logprobs
from engine.rollout.sampler import HFSampler, Sample, SamplingSettings
from engine.run.distributed import init_distributed
from engine.run.preflight import load_tokenizer


def true_scorer(task: str) -> Callable[[str, str], float]:
    """``score(response, prompt)``: the task's true rule (no reward model): the demo's helpful +
    harmless, or the list task's share of distinct words of the asked category."""
    if task == "lists":
        return lambda response, prompt: list_task.true_score(response, list_task.prompt_category(prompt))
    return lambda response, prompt: float(synthetic_task.total_score(response, synthetic_task.prompt_topic(prompt)))


def sampled(policy, tokenizer, prompts: list[list[int]], settings: SamplingSettings, seed: int) -> list[Sample]:
    """``settings.n`` samples per prompt, 16 prompts per ``generate`` call, prompt by prompt."""
    sampler = HFSampler(policy, tokenizer.pad_token_id, tokenizer.eos_token_id)
    return [
        s
        for start in range(0, len(prompts), 16)
        for group in sampler.generate(prompts[start : start + 16], settings, seed + start)
        for s in group
    ]


def kl_per_token(policy, sft, samples: list[Sample], pad_token_id: int) -> float:
    """Sum of log pi(y) - log pi_sft(y) over all samples' response tokens, over their count."""
    sequences = [s.prompt_ids + s.response_ids for s in samples]
    prompt_lens = [len(s.prompt_ids) for s in samples]
    with torch.no_grad():
        policy_lp, sft_lp = (
            sequence_logprobs(m, sequences, prompt_lens, 4096, pad_token_id, share_prompts=True) for m in (policy, sft)
        )
    log_ratio = sum(float((a - b).sum()) for a, b in zip(policy_lp, sft_lp))
    return log_ratio / sum(len(s.response_ids) for s in samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", required=True, help="HF model directory of the trained policy")
    parser.add_argument("--sft", required=True, help="HF model directory of the SFT policy it started from")
    parser.add_argument("--prompts", required=True, help="held-out prompts of the synthetic task (parquet)")
    parser.add_argument("--task", choices=TASKS, default="demo", help="whose true rule scores the samples")
    parser.add_argument("--samples-per-prompt", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    init_distributed()  # one process: the packed forwards' micro-batch plan agrees over "all" ranks
    tokenizer = load_tokenizer(args.sft, "--sft")
    prompts = load_prompts(args.prompts)
    policy, sft = (load_causal_lm(path).eval() for path in (args.policy, args.sft))
    settings = SamplingSettings(n=args.samples_per_prompt, temperature=1.0, max_new_tokens=args.max_new_tokens)
    samples = sampled(policy, tokenizer, [prompt_ids(tokenizer, p.messages) for p in prompts], settings, args.seed)
    score = true_scorer(args.task)
    asked = [p.messages[-1]["content"] for p in prompts for _ in range(args.samples_per_prompt)]
    scores = [
        score(str(tokenizer.decode(s.response_ids, skip_special_tokens=True)), prompt)
        for s, prompt in zip(samples, asked)
    ]
    print(
        json.dumps(
            {
                "score": statistics.mean(scores),
                "score_stderr": statistics.stdev(scores) / len(scores) ** 0.5,
                "kl_per_token": kl_per_token(policy, sft, samples, tokenizer.pad_token_id),
                "response_tokens": statistics.mean(len(s.response_ids) for s in samples),
                "finished": statistics.mean(s.finished for s in samples),
                "samples": len(samples),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
