"""Async rollout vs colocated, on the same 2 ranks: seconds per PPO iteration and where they go.

    python bench/async_vs_colocated.py [--iterations 8] [--new-tokens 16 64 192]
                                       [--hidden-size 128 --num-layers 4 ...]

The set-up of bench/ppo_vs_trl.py (the tiny Llama on HH text, its shape from the flags, a reward
model trained briefly, 16 HH prompts x 1 sample per iteration, one mini-batch, GAE). For each
response length: train_ppo.py colocated (both ranks generate their half, then both train: ZeRO-3
over 2 ranks) against rollout.mode async (rank 1 generates every batch one policy version ahead,
rank 0 trains alone: ZeRO-3 over 1 rank), max_staleness 1. A longer response raises generation's
share of the colocated iteration: the crossover is where async starts to win.

Prints, per length and mode, the median seconds per iteration (the first two excluded: warm-up and
the async pipeline filling) and the median phases: generation (on the generating rank for async),
the trainer's wait for samples, experience forwards, training, weight sync.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from ppo_vs_trl import SHAPE, prepare_ppo_run, run_demo_ppo

MODES = {"colocated": [], "async": ["--rollout.mode", "async", "--rollout.max_staleness", "1"]}
PHASES = {
    "generate": "timing/generate_s",
    "wait": "timing/rollout_wait_s",
    "experience": "timing/make_experience_s",
    "train": "timing/train_s",
    "sync": "timing/sync_s",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64, 192], help="rollout.max_new_tokens")
    for flag, default in SHAPE.items():
        parser.add_argument(f"--{flag}", type=int, default=default, help="of the model built for the run")
    args = parser.parse_args()
    shape = [a for flag in SHAPE for a in (f"--{flag}", str(getattr(args, flag.replace("-", "_"))))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _, _, overrides = prepare_ppo_run(work, shape, args.iterations, 1)
        for tokens in args.new_tokens:
            for mode, extra in MODES.items():
                out = work / f"{mode}_{tokens}"
                run_demo_ppo(
                    [*overrides, "--rollout.max_new_tokens", str(tokens), *extra, "--logging.output_dir", str(out)],
                    ranks=2,
                )
                metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]
                median = {k: statistics.median(m[key] for m in metrics) for k, key in PHASES.items()}
                rows.append((tokens, mode, statistics.median(m["timing/iteration_s"] for m in metrics), median))
    print(
        f"\n{'new tokens':>10} {'mode':<10} {'s/iter':>7} " + " ".join(f"{p:>10}" for p in PHASES) + "  async/colocated"
    )
    colocated = {}
    for tokens, mode, seconds, phases in rows:
        colocated.setdefault(tokens, seconds)
        ratio = f"{colocated[tokens] / seconds:.2f}x" if mode == "async" else ""
        cells = " ".join(f"{phases[p]:>10.3f}" for p in PHASES)
        print(f"{tokens:>10} {mode:<10} {seconds:>7.3f} {cells}  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
