"""Train the tiny model a few steps through our DeepSpeed engine built from shipped configs.

    python tests/scripts/ds_config_steps.py MODEL_DIR DS_CONFIG [DS_CONFIG ...] [--steps 3] [--save-weights DIR]

Each config goes the way the train scripts take it (engine/run_config/common.py and
engine/models/deepspeed_glue.py): dtype resolved from its ``bf16`` section, adapted by
``training_ds_config``, weights loaded partitioned, torch AdamW in ``initialize_training_engine``.
The configs run one after another in this process (one start-up for all).

Every step trains on one global batch of GLOBAL_BATCH sequences (so the loss falls at every step),
the same whatever the world size; each rank takes its contiguous share, and all shares have the
same token count. With the gradient averaged over the ranks, one rank and two ranks then take the
same steps, to float rounding.

Prints on rank 0 one JSON line per config: the config name, the world size, what is in effect in
the engine (``describe_engine``, read from the engine, not the config), the losses (mean over the
ranks, per step) and each rank's own losses. With ``--save-weights DIR`` rank 0 also writes the
full trained weights to ``DIR/<config>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from engine.config import DS_CONFIGS_DIR
from engine.models.deepspeed_glue import (
    describe_engine,
    full_state_dict,
    initialize_training_engine,
    load_partitioned,
    training_ds_config,
)
from engine.run.distributed import init_distributed, shutdown_distributed
from engine.run_config import resolve_deepspeed_dtype

GLOBAL_BATCH, SEQ_LEN = 4, 16


def train(model_dir: str, name: str, steps: int, rank: int, world: int) -> tuple[dict, dict | None]:
    with open(os.path.join(DS_CONFIGS_DIR, name)) as f:
        raw = json.load(f)
    bf16 = resolve_deepspeed_dtype(raw, None, "model.bf16")
    ds_config = training_ds_config(raw, bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(0)
    model, keep_alive = load_partitioned(
        lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), ds_config
    )
    engine = initialize_training_engine(
        model, ds_config, 1e-3, (0.9, 0.999), 0.0, "constant_with_warmup", warmup_steps=0, total_steps=steps
    )
    share = GLOBAL_BATCH // world
    batch = torch.randint(5, 200, (GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    ids = batch[rank * share : (rank + 1) * share]
    local = []
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        local.append(loss.item())
    per_rank = [torch.zeros(steps, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(per_rank, torch.tensor(local, dtype=torch.float64))
    result = {
        "config": name,
        "world": world,
        "in_effect": describe_engine(engine),
        "losses": torch.stack(per_rank).mean(0).tolist(),
        "rank_losses": [r.tolist() for r in per_rank],
    }
    weights = full_state_dict(engine)  # a collective under ZeRO-3
    del engine, keep_alive
    return result, weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("ds_configs", nargs="+")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-weights", default="", help="folder for the trained weights (rank 0)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()
    rank, world = init_distributed(timeout_s=120)
    assert GLOBAL_BATCH % world == 0, f"{world} ranks do not share {GLOBAL_BATCH} sequences"
    for name in args.ds_configs:
        result, weights = train(args.model, name, args.steps, rank, world)
        if rank == 0:
            if args.save_weights:
                torch.save({k: v.float() for k, v in weights.items()}, os.path.join(args.save_weights, f"{name}.pt"))
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    shutdown_distributed()
