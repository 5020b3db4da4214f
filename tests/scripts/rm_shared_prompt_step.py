"""One reward-model step through real DeepSpeed engines, with and without shared prompts.

    deepspeed --num_gpus 2 tests/scripts/rm_shared_prompt_step.py MODEL_DIR PAIRS_PARQUET

For ZeRO-2 and ZeRO-3: a fresh engine per packing (same initial head: same seed), every rank
scores its share of the global token-budget plan (engine/rm/reward_model.score_pairs, chosen
and rejected sharing their prompt's tokens or not), backward of the BT loss, one SGD step
(lr 1, no clipping): ``before - after`` is the averaged gradient. Rank 0 prints one JSON line:
per stage the largest weight difference between the two packings after the step and the
largest update, and the tokens each packing computed.
"""

from __future__ import annotations

import json

import torch
from sgd_engine import full_weights, launched_args, sgd_engine
from transformers import AutoTokenizer

from engine.data.batching import plan_global, token_mean_scale
from engine.data.packing import dummy_forward_loss
from engine.data.preferences import collate_pairs, load_preferences
from engine.rm.losses import pair_losses
from engine.rm.reward_model import score_pairs
from engine.runtime.distributed import shutdown_distributed
from engine.runtime.models import load_value_model

COMPONENTS = ["helpful", "harmless"]
WEIGHTS = torch.tensor([1.0, 1.0])


def step(model_dir: str, examples, stage: int, rank: int, world: int, max_tokens: int):
    """(weights before, weights after one SGD step), from fresh weights."""
    torch.manual_seed(0)  # the same new head
    engine, keep_alive = sgd_engine(lambda: load_value_model(model_dir, COMPONENTS), stage)
    before = full_weights(engine)
    for micro in plan_global([e.num_tokens for e in examples], max_tokens, world)[rank]:
        if not micro:
            engine.backward(dummy_forward_loss(engine, 0))
            continue
        batch = [examples[i] for i in micro]
        r_c, r_r = score_pairs(engine, batch)
        _, margins, labels = collate_pairs(batch)
        engine.backward(pair_losses(r_c, r_r, WEIGHTS, margins, labels).total.sum() * token_mean_scale(len(examples), world))
    engine.step()
    after = full_weights(engine)
    del keep_alive
    return before, after


def main() -> None:
    args, rank, world = launched_args("model", "pairs")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    plain, shared = (load_preferences(args.pairs, tokenizer, COMPONENTS, use_margin=False, share_prompt=s)[:24] for s in (False, True))
    report = {"world": world, "tokens": {"plain": sum(e.num_tokens for e in plain), "shared": sum(e.num_tokens for e in shared)}}
    for stage in (2, 3):
        # A budget of a few pairs: several micro-batches per rank, planned from each packing's own token counts.
        (start, w_plain), (_, w_shared) = (step(args.model, ex, stage, rank, world, max_tokens=400) for ex in (plain, shared))
        report[f"zero{stage}"] = {
            "weight_diff": max((w_plain[n] - w_shared[n]).abs().max().item() for n in w_plain),
            "update": max((w_plain[n] - start[n]).abs().max().item() for n in w_plain),
        }
    if rank == 0:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
    shutdown_distributed()
