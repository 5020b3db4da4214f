"""How right a frontier task's reward model is, and what else it prefers: its held-out pairs scored.

    python bench/frontier_rm_check.py --reward-model runs/frontier/lists/rm/model \
        --pairs runs/frontier/lists/data/validation.parquet [--task lists]

Each held-out pair's two responses are scored as PPO scores a sampled response (engine/ppo/rewards.py
``RewardModelScorer``: the prompt's ids, the response's with the leading space the spaced template's
generation prompt leaves to it, then the closing). Prints one JSON line: the share of pairs where the
reward model prefers the labelled choice (train_rm.py's validation accuracy) and the one with the
higher true score; on the pairs where the longer response has the lower true score, the share where
it prefers the longer; and the correlation of its score and of the true score with the response's
length in words.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import pyarrow.parquet as pq
import torch
from frontier_eval import true_scorer
from frontier_tasks import TASKS

from engine.data.chat import prompt_ids
from engine.models.loading import load_value_model
from engine.ppo.rewards import RewardModelScorer, SampledResponses
from engine.rollout.sampler import Sample
from engine.run.distributed import init_distributed
from engine.run.preflight import load_tokenizer
from engine.run_config.rewards import RewardModelSection


def rm_scores(path: str, prompts: list[list[dict]], texts: list[str]) -> list[float]:
    """The reward model's standardised total of each response, read as a finished sample."""
    tokenizer = load_tokenizer(path, "--reward-model")
    scorer = RewardModelScorer(
        load_value_model(path).eval(), tokenizer, RewardModelSection(path=path), 4096, policy_tokenizer=tokenizer
    )
    eos = tokenizer.eos_token_id
    samples = [Sample(prompt_ids(tokenizer, p), [eos], [0.0], True) for p in prompts]
    with torch.no_grad():
        return scorer.total(scorer.score(SampledResponses(prompts, samples, texts, [{}] * len(texts)))).tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reward-model", required=True, help="train_rm.py's model/")
    parser.add_argument("--pairs", required=True, help="held-out pairs (prepare_preferences' validation.parquet)")
    parser.add_argument("--task", choices=TASKS, default="lists")
    parser.add_argument("--no-space", action="store_true", help="responses as the pairs have them (chatml template)")
    args = parser.parse_args()
    init_distributed()  # one process: the scorer's micro-batch plan agrees over "all" ranks
    rows = pq.read_table(args.pairs, columns=["prompt", "chosen", "rejected"]).to_pylist()
    space = "" if args.no_space else " "
    prompts = [r["prompt"] for r in rows for _ in range(2)]
    texts = [space + r[side] for r in rows for side in ("chosen", "rejected")]
    rm = rm_scores(args.reward_model, prompts, texts)
    score = true_scorer(args.task)
    true = [score(t, p[-1]["content"]) for t, p in zip(texts, prompts)]
    length = [len(t.split()) for t in texts]
    pairs = list(zip(rm[0::2], rm[1::2], true[0::2], true[1::2], length[0::2], length[1::2]))
    conflicting = [(rc > rr) == (lc > lr) for rc, rr, tc, tr, lc, lr in pairs if lc != lr and (lc > lr) != (tc > tr)]
    print(
        json.dumps(
            {
                "pairs": len(rows),
                "accuracy_labels": statistics.mean(rc > rr for rc, rr, *_ in pairs),
                "accuracy_true_rule": statistics.mean((rc > rr) == (tc > tr) for rc, rr, tc, tr, *_ in pairs),
                "length_conflicting_pairs": len(conflicting),
                "prefers_longer_when_conflicting": statistics.mean(conflicting) if conflicting else None,
                "corr_rm_length": statistics.correlation(rm, [float(n) for n in length]),
                "corr_true_length": statistics.correlation(true, [float(n) for n in length]),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
