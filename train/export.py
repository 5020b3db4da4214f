"""Export a checkpoint of a run (SFT, RM, DPO or PPO) as an HF model directory.

    python train/export.py --checkpoint RUN_DIR[/checkpoints[/stepNNNNNNNN]] --out DIR
        [--engine model|actor|critic] [--overwrite]

Recipe: the checkpoint (a run directory: the one its ``checkpoints/latest`` names; a damaged one
refused) -> the run's config.json -> the engine's model (``model``; PPO ``actor`` by default, or
``critic``) and its tokenizer -> its fp32 weights gathered from the ZeRO shards by DeepSpeed's
zero_to_fp32 -> the model its run built (LoRA: base + adapters) -> the directory the trainers
write (safetensors + config + tokenizer; LoRA merged, with ``adapter/`` in PEFT format), in the
run's dtype, with ``train_config.json`` and ``exported_from.json``. An existing ``--out`` is refused
unless ``--overwrite``. Runs on one process, no accelerator needed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from engine.config import config_to_dict
from engine.export.source import exported_model, find_checkpoint, run_config
from engine.export.weights import checkpoint_state, model_with_weights, write_export
from engine.run.distributed import init_distributed
from engine.run.launch import RunRefused, run_main
from engine.run.preflight import check_weights, load_tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python train/export.py", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a run directory, its checkpoints/, or a checkpoint")
    parser.add_argument("--out", required=True, help="the HF model directory to write")
    parser.add_argument(
        "--engine", choices=("model", "actor", "critic"), help="the engine to export (default: model; PPO: actor)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    checkpoint = find_checkpoint(args.checkpoint)
    config = run_config(checkpoint)
    spec = exported_model(config, args.engine)
    if os.path.exists(args.out) and not args.overwrite:
        raise RunRefused("output", f"--out {args.out} exists: pass --overwrite to replace it, or choose another")
    tokenizer = load_tokenizer(
        spec.path, spec.key, spec.trust_remote_code, chat_template=spec.chat_template, template_key=spec.key
    )
    check_weights(spec.path, spec.key, spec.value_head, spec.trust_remote_code)
    init_distributed()  # one process: the LoRA merge reads its layers as the trainers' rank 0 does
    state = checkpoint_state(checkpoint.path, spec.engine, trained_only=bool(spec.lora.rank))
    model = model_with_weights(spec, state)
    provenance = {"checkpoint": checkpoint.path, "step": checkpoint.step, "engine": spec.engine}
    extra = {"train_config.json": config_to_dict(config), "exported_from.json": provenance}
    write_export(model, state, tokenizer, args.out, extra)
    note = ""
    if spec.value_head and spec.engine == "model":
        note = "; no reward_stats.json (train_rm.py writes it at the end): score it with reward_model.normalize false"
    print(f"exported {spec.engine} of {checkpoint.path} (step {checkpoint.step}) to {args.out}{note}")
    return 0


if __name__ == "__main__":
    run_main(main)
