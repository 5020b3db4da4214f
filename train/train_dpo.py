"""Direct preference optimisation (DPO, IPO, SimPO) of a causal LM on preference pairs.

    deepspeed --num_gpus N train/train_dpo.py --config ds_configs/demo_dpo.json
        [--resume | --overwrite] [--dry-run] [--section.key value ...]

Recipe: config -> process group -> tokenizer and pairs -> output-directory checks -> policy in a
DeepSpeed engine (LoRA: adapters on it) -> start or resume the run -> the reference's log-probs of
every pair in one pass (a new run; a resumed one reads them from its checkpoint) -> loop
(token-budget packed micro-batches, a pair's prompt once, one optimizer step per
``pairs_per_step`` pairs, periodic evaluation and checkpoints) -> final evaluation -> HF model ->
report.
"""

from __future__ import annotations

import engine.run.cpu_threads  # noqa: F401 -- first: OpenMP's wait policy, before torch loads libgomp

# isort: split
import time
from functools import partial

from engine.data.preferences import PreferenceExample, load_fitting_pairs
from engine.dpo.reference import ReferenceLogprobs
from engine.dpo.training import PreferenceLossSettings, dpo_step, evaluate_preferences
from engine.models.loading import attention_shares_prompts
from engine.run.checkpoint import content_fingerprint
from engine.run.dry_run import dpo_plan
from engine.run.launch import run_main, start_run
from engine.run.supervised import SupervisedRun
from engine.run_config import DPOConfig


def load_pairs(path: str, tokenizer, cfg: DPOConfig, rank: int) -> list[PreferenceExample]:
    """The pairs of ``path`` that fit one micro-batch, their prompts marked to pack once where the
    attention implementation can (dpo.share_prompt)."""
    share = cfg.dpo.share_prompt and attention_shares_prompts(cfg.model.attn_implementation, cfg.model.bf16)
    return load_fitting_pairs(path, tokenizer, [], False, share, cfg.train.max_tokens_per_micro_batch, rank)


def main() -> int:
    cfg, run_args, rank, world, _ = start_run(DPOConfig, __doc__.split("\n")[0])
    budget, per_step = cfg.train.max_tokens_per_micro_batch, cfg.train.pairs_per_step
    sup = SupervisedRun(cfg, run_args, rank, world, lora=cfg.model.lora)
    settings = PreferenceLossSettings.from_config(cfg.dpo)
    train, validation = (load_pairs(path, sup.tokenizer, cfg, rank) for path in (cfg.data.train, cfg.data.validation))
    if run_args.dry_run:
        return dpo_plan(cfg, train, validation, sup.ds_config, world, run_args.device_memory_gib) if rank == 0 else 0
    run = sup.open(
        train,
        per_step,
        {"data.validation": content_fingerprint(cfg.data.validation), "loss": cfg.dpo.loss, "pairs_per_step": per_step},
    )

    reference = ReferenceLogprobs()
    run.track("reference", reference, rolls_back=False)
    engine = sup.start(desc=cfg.dpo.loss)
    pad = sup.tokenizer.pad_token_id
    if not run.resume_from:
        start = time.perf_counter()
        engine.eval()
        reference.compute(engine, train, validation, budget, pad, cfg.dpo.uses_reference())
        run.logger.log(0, {"timing/reference_s": time.perf_counter() - start})
    sup.announce(
        f"train_dpo: {cfg.dpo.loss} (beta {settings.beta}), {len(train)} train / {len(validation)} validation pairs"
    )
    evaluate = partial(evaluate_preferences, engine, validation, reference, settings, budget, pad)
    ended = sup.train(
        "dpo",
        lambda batch, indices, step: dpo_step(engine, batch, reference.train[indices], settings, budget, pad, step),
        evaluate,
    )
    if ended is not None:
        return ended

    final = sup.evaluate_final(evaluate)
    return sup.export(
        f"validation accuracy {final['acc']:.3f}, margin {final['margin']:.3f}, loss {final['loss']:.4f}, "
        f"KL to the reference {final['kl']:.4f} nats/token"
    )


if __name__ == "__main__":
    run_main(main)
