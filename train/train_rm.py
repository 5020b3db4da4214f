"""Train a Bradley-Terry reward model on preference pairs.

    deepspeed --num_gpus N train/train_rm.py --config ds_configs/demo_rm.json
        [--resume | --overwrite] [--dry-run] [--section.key value ...]

Recipe: config -> process group -> tokenizer and data -> output-directory checks -> value model
in a DeepSpeed engine -> start or resume the run -> loop (token-budget packed micro-batches, one
optimizer step per ``pairs_per_step`` pairs, periodic evaluation and checkpoints) -> final
evaluation -> HF model with reward statistics -> report.
"""

from __future__ import annotations

import engine.run.cpu_threads  # noqa: F401 -- first: OpenMP's wait policy, before torch loads libgomp

# isort: split
from functools import partial

from engine.data.preferences import PreferenceExample, load_fitting_pairs
from engine.models.loading import attention_shares_prompts
from engine.rm.reward_model import RMLossSettings, evaluate_pairs, rm_step
from engine.run.dry_run import rm_plan
from engine.run.launch import run_main, start_run
from engine.run.supervised import SupervisedRun
from engine.run_config import RewardModelConfig


def shares_prompts(cfg: RewardModelConfig) -> bool:
    """rm.share_prompt, where the attention implementation in effect runs shared-prompt rows (sdpa_varlen)."""
    return cfg.rm.share_prompt and attention_shares_prompts(cfg.model.attn_implementation, cfg.model.bf16)


def load_pairs(path: str, tokenizer, cfg: RewardModelConfig, rank: int) -> list[PreferenceExample]:
    """The pairs of ``path`` that fit one micro-batch, their prompts marked to pack once where the
    attention implementation can (rm.share_prompt)."""
    return load_fitting_pairs(
        path,
        tokenizer,
        list(cfg.rm.components),
        cfg.data.use_margin,
        shares_prompts(cfg),
        cfg.train.max_tokens_per_micro_batch,
        rank,
    )


def reward_stats(final: dict[str, float], cfg: RewardModelConfig, validation_pairs: int) -> dict:
    """The reward's mean and spread on the validation pairs, in total and per component (reward_stats.json)."""
    return {
        "mean": final["reward_mean"],
        "std": final["reward_std"],
        "components": {
            c: {"mean": final[f"reward_mean_{c}"], "std": final[f"reward_std_{c}"]} for c in cfg.rm.components
        },
        "weights": cfg.rm.components,
        "validation_pairs": validation_pairs,
    }


def main() -> int:
    cfg, run_args, rank, world, _ = start_run(RewardModelConfig, __doc__.split("\n")[0])
    budget, per_step = cfg.train.max_tokens_per_micro_batch, cfg.train.pairs_per_step
    loss_settings = RMLossSettings.from_config(cfg.rm)
    components, weights = list(loss_settings.components), loss_settings.weights
    sup = SupervisedRun(cfg, run_args, rank, world, components=components)
    train, validation = (load_pairs(path, sup.tokenizer, cfg, rank) for path in (cfg.data.train, cfg.data.validation))
    if run_args.dry_run:
        return rm_plan(cfg, train, validation, sup.ds_config, world, run_args.device_memory_gib) if rank == 0 else 0
    sup.open(train, per_step, {"components": cfg.rm.components, "pairs_per_step": per_step})

    engine = sup.start(desc="rm")
    sup.announce(f"train_rm: {len(train)} train / {len(validation)} validation pairs")
    pad = sup.tokenizer.pad_token_id
    evaluate = partial(evaluate_pairs, engine, validation, components, weights, budget, pad)
    ended = sup.train("rm", lambda batch, _, step: rm_step(engine, batch, loss_settings, budget, pad, step), evaluate)
    if ended is not None:
        return ended

    final = sup.evaluate_final(evaluate)
    per_component = ", ".join(f"{c} {final[f'acc_{c}']:.3f}" for c in components if f"acc_{c}" in final)
    return sup.export(
        f"validation accuracy {final['acc']:.3f}"
        + (f" ({per_component})" if per_component else "")
        + f", margin {final['margin']:.3f}, loss {final['loss_total']:.4f}",
        {"reward_stats.json": reward_stats(final, cfg, len(validation))},
    )


if __name__ == "__main__":
    run_main(main)
