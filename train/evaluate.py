"""Evaluate a model on a prompts file: pass@k under a verifier, the mean reward, the mean reward-model
score and the win rate over a baseline.

    python train/evaluate.py --model DIR --prompts FILE --out DIR
        [--verifier math|code|format [--field COLUMN] | --rewards-from PPO_CONFIG] [--reward-model DIR]
        [--baseline DIR] [--samples N] [--temperature T] [--top-p P] [--max-new-tokens M] [--seed S]

Recipe: settings -> checks before any model loads (the output, the prompts and the columns the
verifier reads, each model's tokenizer, weights and vLLM support, the reward model, the reward
workers) -> one-process group -> per model (``--model``, then ``--baseline``): vLLM in this process
samples n responses per prompt, the same seed for both -> the rewards section's components and the
reward model score them -> summary.json and samples.jsonl in --out, the figures printed.
"""

from __future__ import annotations

import engine.run.cpu_threads  # noqa: F401 -- first: OpenMP's wait policy, before torch loads libgomp

# isort: split
import json
from collections.abc import Sequence
from typing import Any

from engine.data.chat import prompt_ids
from engine.data.prompts import load_prompts
from engine.evaluate.policy import (
    context_length,
    sample_policy,
    score_with_reward_model,
    score_with_rewards,
)
from engine.evaluate.report import check_out_dir, policy_summary, win_rate, write_report
from engine.evaluate.settings import parse_settings
from engine.models.loading import load_value_model
from engine.ppo.rewards import RewardModelScorer
from engine.rewards.components import RewardComponents, RewardsConfigError, RewardsUnavailable
from engine.run.distributed import init_distributed
from engine.run.launch import RunRefused, run_main
from engine.run.preflight import check_reward_model, check_vllm_can_run, check_weights, load_tokenizer
from engine.run_config.rewards import RewardModelSection


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv, "python train/evaluate.py", __doc__.split("\n")[0])
    check_out_dir(settings.out, settings.overwrite)
    section, readers = settings.rewards()
    prompts = load_prompts(settings.prompts, readers)
    models = {"model": settings.model} | ({"baseline": settings.baseline} if settings.baseline else {})
    tokenizers, contexts = {}, {}
    for name, path in models.items():
        tokenizers[name] = load_tokenizer(path, f"--{name}")
        check_weights(path, f"--{name}", value_head=False)
        check_vllm_can_run(path, f"--{name}")
        ids = [prompt_ids(tokenizers[name], p.messages) for p in prompts]
        contexts[name] = context_length(path, f"--{name}", ids, settings.max_new_tokens)
    rm = settings.reward_model
    if rm:
        check_weights(rm, "--reward-model", value_head=True)
        check_reward_model(rm, "--reward-model", normalize=False)
        rm_tokenizer = load_tokenizer(rm, "--reward-model")
    components = RewardComponents(section, settings.max_new_tokens) if section else None
    try:
        if components:
            components.check(key=f"{settings.rewards_from}: rewards" if settings.rewards_from else "--verifier")
        init_distributed()  # one process: vLLM's executor and the scorers' collectives use its group
        policies = {
            name: sample_policy(path, prompts, tokenizers[name], settings, contexts[name])
            for name, path in models.items()
        }
        if section and components:
            for policy in policies.values():
                score_with_rewards(policy, section, components)
    except RewardsConfigError as e:
        raise RunRefused("config", str(e)) from None
    except RewardsUnavailable as e:
        raise RunRefused("reward", str(e)) from None
    finally:
        if components:
            components.close()
    if rm:
        reward_model = load_value_model(rm).eval()
        heads = RewardModelSection(path=rm, normalize=False)  # weighted, unstandardised: only the order matters
        budget = settings.max_tokens_per_micro_batch
        for name, policy in policies.items():
            scorer = RewardModelScorer(reward_model, rm_tokenizer, heads, budget, policy_tokenizer=tokenizers[name])
            score_with_reward_model(policy, scorer)
    summary: dict[str, Any] = {
        "prompts": settings.prompts,
        "prompt_count": len(prompts),
        "sampling": settings.model_dump(include={"samples", "temperature", "top_p", "max_new_tokens", "seed"}),
        **{name: policy_summary(policy) for name, policy in policies.items()},
    }
    if rm and "baseline" in policies:
        summary |= win_rate(policies["model"], policies["baseline"])
    write_report(settings.out, summary, policies)
    print(json.dumps(summary))
    print(f"wrote {settings.out}/summary.json and {settings.out}/samples.jsonl")
    return 0


if __name__ == "__main__":
    run_main(main)
