"""Held-out win rate of one policy over another, judged by a reward model: how the docs compare the
demo's DPO and PPO policies with the SFT model they start from.

    python -m engine.ppo.win_rate --policy runs/demo/dpo/model --baseline runs/demo/sft/model \\
        --reward-model runs/demo/rm/model --prompts runs/demo/data/prompts_validation.parquet

Each policy samples one response per prompt (HF ``generate``, the same request seed for both), the
reward model scores both (its weighted total, as PPO's reward model scorer, unnormalised: only the
order matters), and each prompt counts 1 when the policy's response scores higher, 0.5 on a tie
(PPO's ``eval/win_rate``). Prints one JSON line. Runs on one process; an unreadable model or prompts file exits 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from engine.data.chat import prompt_ids
from engine.data.prompts import Prompt, load_prompts
from engine.models.loading import load_causal_lm, load_value_model
from engine.ppo.evaluation import win_scores
from engine.ppo.rewards import RewardModelScorer, SampledResponses
from engine.rollout.sampler import HFSampler, SamplingSettings
from engine.run.distributed import init_distributed
from engine.run.launch import run_main
from engine.run.preflight import check_weights, load_tokenizer
from engine.run_config.rewards import RewardModelSection


def sampled_responses(
    path: str, flag: str, prompts: list[Prompt], settings: SamplingSettings, seed: int, batch: int
) -> tuple[SampledResponses, PreTrainedTokenizerBase]:
    """One response of the policy at ``path`` (the command line's ``flag``) to each prompt, rendered
    with its own tokenizer and chat template, and that tokenizer."""
    tokenizer = load_tokenizer(path, flag)
    check_weights(path, flag, value_head=False)
    ids = [prompt_ids(tokenizer, p.messages) for p in prompts]
    model = load_causal_lm(path).eval()
    sampler = HFSampler(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    samples = [
        group[0]
        for start in range(0, len(ids), batch)
        for group in sampler.generate(ids[start : start + batch], settings, seed + start)
    ]
    return SampledResponses.decode(prompts, samples, tokenizer), tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.ppo.win_rate", description=__doc__.split("\n")[0])
    parser.add_argument("--policy", required=True, help="HF model directory of the policy")
    parser.add_argument("--baseline", required=True, help="HF model directory of the policy it is compared with")
    parser.add_argument("--reward-model", required=True, help="reward model directory (train_rm.py's model/)")
    parser.add_argument("--prompts", required=True, help="held-out prompts parquet (prompts_validation.parquet)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=64, help="prompts per generate call")
    args = parser.parse_args(argv)
    init_distributed()  # one process: the scorer's micro-batch plan agrees over "all" ranks
    check_weights(args.reward_model, "--reward-model", value_head=True)
    prompts = load_prompts(args.prompts)
    settings = SamplingSettings(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    responses = {
        name: sampled_responses(path, f"--{name}", prompts, settings, args.seed, args.batch)
        for name, path in (("policy", args.policy), ("baseline", args.baseline))
    }
    reward_model = load_value_model(args.reward_model).eval()
    reward_tokenizer = load_tokenizer(args.reward_model, "--reward-model")
    section = RewardModelSection(path=args.reward_model, normalize=False)
    rewards = {}
    for name, (sampled, tokenizer) in responses.items():  # each policy's ids where it shares the RM's tokenizer
        scorer = RewardModelScorer(reward_model, reward_tokenizer, section, 4096, policy_tokenizer=tokenizer)
        rewards[name] = scorer.total(scorer.score(sampled))
    lengths = {name: sum(len(s.response_ids) for s in r.samples) / len(r.samples) for name, (r, _) in responses.items()}
    wins = win_scores(rewards["policy"], rewards["baseline"])
    print(
        json.dumps(
            {
                "policy": args.policy,
                "baseline": args.baseline,
                "prompts": len(prompts),
                "win_rate": wins.mean().item(),
                "win_rate_stderr": (wins.std() / len(prompts) ** 0.5).item(),
                "policy_reward": rewards["policy"].mean().item(),
                "baseline_reward": rewards["baseline"].mean().item(),
                "policy_length": lengths["policy"],
                "baseline_length": lengths["baseline"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    run_main(main)
