"""SGD steps of packed, token-budget micro-batches through a real ZeRO-3 engine.

    deepspeed --num_gpus 2 tests/scripts/packed_zero3_step.py MODEL_DIR OUT_DIR

For each mini-batch case every rank runs its share of the global plan (equal micro-step
counts, an empty micro-batch as a zero-weight dummy), then one SGD step (lr 1, no clipping),
so ``before - after`` is the averaged gradient. Rank 0 saves the full weights before and
after each step to OUT_DIR/case{k}.pt and prints one JSON line with the micro-steps and the
items each rank trained on.
"""

from __future__ import annotations

import json
import os

import torch
from sgd_engine import full_weights, launched_args, sgd_engine

from engine.data.batching import plan_global, token_mean_scale
from engine.data.packing import next_token_logprobs, pack_sequences, packed_forward
from engine.models.loading import load_causal_lm
from engine.run.distributed import shutdown_distributed

# (sequence lengths, max_tokens): mixed lengths; and one where a rank gets an empty micro-batch.
CASES = [([7, 1, 23, 12, 2, 30, 9], 40), ([30, 30, 30], 32)]


def make_sequences(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def main() -> None:
    args, rank, world = launched_args("model", "out")
    engine, keep_alive = sgd_engine(lambda: load_causal_lm(args.model))
    model = engine.module

    report = []
    for k, (lengths, max_tokens) in enumerate(CASES):
        seqs = make_sequences(lengths, model.config.vocab_size, seed=k)
        plan = plan_global(lengths, max_tokens, world)[rank]
        scale = token_mean_scale(sum(n - 1 for n in lengths), world)
        before = full_weights(engine)
        for micro in plan:
            packed = pack_sequences([seqs[i] for i in micro])
            logits = packed_forward(engine, packed)
            if packed.seq_lens:
                loss = -torch.cat(next_token_logprobs(logits, packed)).sum() * scale
            else:
                loss = logits.sum() * 0.0  # dummy: same collectives, no gradient contribution
            engine.backward(loss)
        engine.step()
        after = full_weights(engine)
        seen = [None] * world
        torch.distributed.all_gather_object(
            seen, {"micro_steps": len(plan), "items": sorted(i for b in plan for i in b)}
        )
        if rank == 0:
            torch.save({"sequences": seqs, "before": before, "after": after}, os.path.join(args.out, f"case{k}.pt"))
            report.append({"ranks": seen})
    if rank == 0:
        print(json.dumps({"world": world, "cases": report}))
    del keep_alive


if __name__ == "__main__":
    main()
    shutdown_distributed()
