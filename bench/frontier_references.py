"""Best-of-n sampling from the SFT model and the KL-regularised optimum on the frontier's axes: the
references a KL-efficient trainer is measured against (Gao et al. 2022, "Scaling Laws for Reward
Model Overoptimization").

    python bench/frontier_references.py --sft DIR --reward-model DIR --prompts prompts_validation.parquet
                                       [--samples-per-prompt 128] [--ns 1 2 4 8 16 32 64 128]
                                       [--betas 2 1 0.5 0.3 0.2 0.1 0.05] [--ensemble DIR ...]
                                       [--uncertainty-penalties 1.0] [--task demo|lists] [--seed 0]

Each held-out prompt gets M samples from the SFT model (bench/frontier_eval.py's sampling), scored
by the reward model (its standardised weighted total, as PPO reads it) and by the task's rule. The
best-of-n policy answers with the reward model's favourite of n fresh samples; its expected true
score is estimated without bias from the M samples: ranked by reward model score, the i-th lowest
(0-based) is the best of a random n-subset with probability C(i, n-1) / C(M, n). Its KL to the SFT
model is log(n) - (n-1)/n per response (Beirami et al. 2024: exact for distinct scores, an upper
bound with ties), per token over the expected best-of-n response length. The optimum of PPO's
objective at each KL coefficient beta comes from the same samples (:func:`tilted_point`). With
``--ensemble`` (more reward models, e.g. trained with other seeds) both references are computed
again for each member alone, the members' mean and their mean - lambda std (each standardised).
Prints one JSON line per reward, n and beta.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
from frontier_eval import sampled, true_scorer
from frontier_tasks import TASKS

from engine.data.chat import prompt_ids
from engine.data.prompts import load_prompts
from engine.models.loading import load_causal_lm, load_value_model
from engine.ppo.rewards import RewardModelScorer, SampledResponses
from engine.rollout.sampler import SamplingSettings
from engine.run.distributed import init_distributed
from engine.run.preflight import load_tokenizer
from engine.run_config.rewards import RewardModelSection


def best_of_n_weights(m: int, n: int) -> torch.Tensor:
    """(M,) probability that the i-th lowest of M ranked samples is the best of a random n-subset."""
    return torch.tensor([math.comb(i, n - 1) / math.comb(m, n) for i in range(m)], dtype=torch.float64)


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n || base) of one response: log n - (n - 1) / n (an upper bound when scores tie)."""
    return math.log(n) - (n - 1) / n


def best_of_n_point(rm: torch.Tensor, true: torch.Tensor, length: torch.Tensor, n: int) -> dict[str, float]:
    """Expected true score, response length and KL per token of best-of-n; each tensor (P, M): P
    prompts' M samples."""
    order = rm.argsort(dim=1, stable=True)  # ranked by the reward model, lowest first
    w = best_of_n_weights(rm.shape[1], n)  # (M,)
    score = (true.gather(1, order).double() * w).sum(1).mean()
    tokens = (length.gather(1, order).double() * w).sum(1).mean()
    return {
        "n": n,
        "score": float(score),
        "kl_per_token": best_of_n_kl(n) / float(tokens),
        "response_tokens": float(tokens),
    }


def tilted_point(rm: torch.Tensor, true: torch.Tensor, length: torch.Tensor, beta: float) -> dict[str, float]:
    """The same for pi_beta ~ pi_sft * exp(r / beta), the optimum of E[r] - beta * KL (the objective PPO
    with the KL in the reward at coefficient beta maximises; Korbak et al. 2022), estimated with
    self-normalised importance weights over each prompt's M samples: the plug-in KL sum w log(M w)
    is at most log M, so points whose effective sample size is a few samples read low."""
    w = torch.softmax(rm.double() / beta, dim=1)  # (P, M)
    kl = torch.xlogy(w, w * rm.shape[1]).sum(1).mean()
    tokens = (length.double() * w).sum(1).mean()
    return {
        "beta": beta,
        "score": float((true.double() * w).sum(1).mean()),
        "kl_per_token": float(kl / tokens),
        "response_tokens": float(tokens),
        "effective_samples": float((1 / (w**2).sum(1)).mean()),
    }


def standardised_totals(path: str, responses: SampledResponses, policy_tokenizer) -> torch.Tensor:
    """(B,) the reward model's weighted total, standardised with its reward_stats.json (as PPO reads it)."""
    scorer = RewardModelScorer(
        load_value_model(path).eval(),
        load_tokenizer(path, "--reward-model"),
        RewardModelSection(path=path),
        max_tokens=4096,
        policy_tokenizer=policy_tokenizer,
    )
    return scorer.total(scorer.score(responses))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft", required=True, help="HF model directory of the SFT policy")
    parser.add_argument("--reward-model", required=True, help="reward model directory (train_rm.py's model/)")
    parser.add_argument("--ensemble", nargs="*", default=[], help="more reward models: references of the members' mean")
    parser.add_argument(
        "--uncertainty-penalties", type=float, nargs="+", default=[1.0], help="lambda of mean - lambda std"
    )
    parser.add_argument("--prompts", required=True, help="held-out prompts of the synthetic task (parquet)")
    parser.add_argument("--task", choices=TASKS, default="demo", help="whose true rule scores the samples")
    parser.add_argument("--samples-per-prompt", type=int, default=128)
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--betas", type=float, nargs="+", default=[2.0, 1.0, 0.5, 0.3, 0.2, 0.1, 0.05])
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    init_distributed()  # one process: the scorer's micro-batch plan agrees over "all" ranks
    tokenizer = load_tokenizer(args.sft, "--sft")
    prompts = load_prompts(args.prompts)
    m = args.samples_per_prompt
    settings = SamplingSettings(n=m, temperature=1.0, max_new_tokens=args.max_new_tokens)
    samples = sampled(
        load_causal_lm(args.sft).eval(),
        tokenizer,
        [prompt_ids(tokenizer, p.messages) for p in prompts],
        settings,
        args.seed,
    )
    responses = SampledResponses.decode([p for p in prompts for _ in range(m)], samples, tokenizer)
    texts, messages = responses.texts, responses.prompts
    members = [
        standardised_totals(path, responses, tokenizer).view(len(prompts), m)
        for path in [args.reward_model, *args.ensemble]
    ]
    rewards = {"rm": members[0]} | {f"member {k + 1}": r for k, r in enumerate(members[1:], start=1)}
    if args.ensemble:
        stacked = torch.stack(members)  # (K, P, M)
        rewards[f"mean of {len(members)}"] = stacked.mean(0)
        for penalty in args.uncertainty_penalties:  # uncertainty-weighted optimisation (Coste et al. 2023)
            rewards[f"mean - {penalty:g} std of {len(members)}"] = stacked.mean(0) - penalty * stacked.std(0)
    score = true_scorer(args.task)
    true = torch.tensor([score(t, p[-1]["content"]) for t, p in zip(texts, messages)]).view(len(prompts), m)
    length = torch.tensor([len(s.response_ids) for s in samples]).view(len(prompts), m)
    for name, rm in rewards.items():
        for n in args.ns:
            print(json.dumps({"reward": name} | best_of_n_point(rm, true, length, n)))
        for beta in args.betas:
            print(json.dumps({"reward": name} | tilted_point(rm, true, length, beta)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
