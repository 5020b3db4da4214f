"""On-policy distillation on the demo's task: the demo's SFT model teaches a less-trained student.

    python bench/distill_demo.py [--mode reverse_kl|gkd] [--iterations 10] [--student-steps 8]
                                 [--work /tmp/distill-demo] [--reward] [--lmbda 1.0]

Builds what the demo builds (data_prep/run_demo.sh: the synthetic task, the tiny model, the SFT
model with ds_configs/demo_sft.json, the reward model with demo_rm.json) under --work, kept and
reused, and a student: the tiny model after --student-steps SFT steps. Then train/train_ppo.py with
ds_configs/demo_distill.json: the SFT model as the teacher, GRPO, no reward in the objective (unless
--reward: the reward model's score too), the reward model as the judge, which scores the held-out
responses without training on them. ``--lmbda`` < 1 (gkd): that share of the iterations sampled, the
others on the dataset's responses, each training prompt's first chosen response among the pairs
(a copy of the prompt file with a ``response`` column). Prints, at the start and after the last iteration, the held-out
reverse KL to the teacher per token, the judge's reward, and seconds per iteration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rm_vs_trl import run

CONFIG = "ds_configs/demo_distill.json"
QUIET = ["--logging.wandb", "false", "--logging.tensorboard", "false", "--logging.progress_bar", "false"]


def prepare(work: Path) -> None:
    """The demo's data, tiny model, SFT model (the teacher) and reward model under ``work``, once."""
    py, raw, data = sys.executable, work / "raw", work / "data"
    if not (work / "tiny" / "config.json").exists():
        run(
            [py, "-m", "data_prep.synthetic_task", "--out", str(raw / "pairs.jsonl"), "--num-pairs", "3000"]
            + ["--demonstrations-out", str(raw / "demonstrations.jsonl"), "--num-demonstrations", "2000"]
        )
        run([py, "-m", "data_prep.make_tiny_model", "--text", str(raw / "pairs.jsonl"), "--out", str(work / "tiny")])
        for step in ("prepare_sft", "prepare_preferences"):
            source = "demonstrations" if step == "prepare_sft" else "pairs"
            run([py, "-m", f"data_prep.{step}", "--input", str(raw / f"{source}.jsonl")]
                + ["--tokenizer", str(work / "tiny"), "--out", str(data)])  # fmt: skip
    sft = ["--model.path", str(work / "tiny"), "--data.train", str(data / "sft_train.parquet")]
    sft += ["--data.validation", str(data / "sft_validation.parquet"), *QUIET]
    if not (work / "sft" / "model" / "model.safetensors").exists():
        run([py, "train/train_sft.py", "--config", "ds_configs/demo_sft.json", *sft]
            + ["--logging.output_dir", str(work / "sft"), "--overwrite"])  # fmt: skip
    if not (work / "rm" / "model" / "reward_stats.json").exists():
        run([py, "train/train_rm.py", "--config", "ds_configs/demo_rm.json"]
            + ["--model.path", str(work / "sft" / "model"), "--data.train", str(data / "train.parquet")]
            + ["--data.validation", str(data / "validation.parquet")]
            + [*QUIET, "--logging.output_dir", str(work / "rm"), "--overwrite"])  # fmt: skip


def student(work: Path, steps: int) -> Path:
    """The tiny model after ``steps`` SFT steps (the demo's SFT config), once per step count."""
    out = work / f"student-{steps}"
    if not (out / "model" / "model.safetensors").exists():
        data = work / "data"
        run([sys.executable, "train/train_sft.py", "--config", "ds_configs/demo_sft.json"]
            + ["--model.path", str(work / "tiny"), "--data.train", str(data / "sft_train.parquet")]
            + ["--data.validation", str(data / "sft_validation.parquet"), "--train.max_steps", str(steps)]
            + ["--train.eval_every_steps", "0", *QUIET, "--logging.output_dir", str(out), "--overwrite"])  # fmt: skip
    return out / "model"


def with_responses(data: Path) -> Path:
    """The training prompt file with a ``response`` column: each prompt's first chosen response in the
    training pairs (written once)."""
    out = data / "prompts_train_responses.parquet"
    if not out.exists():
        chosen: dict[str, str] = {}
        for pair in pq.read_table(data / "train.parquet", columns=["prompt", "chosen"]).to_pylist():
            chosen.setdefault(json.dumps(pair["prompt"]), pair["chosen"])
        prompts = pq.read_table(data / "prompts_train.parquet")
        responses = [chosen[json.dumps(p)] for p in prompts.column("prompt").to_pylist()]
        pq.write_table(prompts.append_column("response", pa.array(responses)), out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["reverse_kl", "gkd"], default="reverse_kl")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--student-steps", type=int, default=8)
    parser.add_argument("--work", default="/tmp/distill-demo")
    parser.add_argument("--reward", action="store_true", help="the reward model's score in the objective too")
    parser.add_argument("--lmbda", type=float, default=1.0, help="gkd: the share of iterations sampled (on-policy)")
    args, extra = parser.parse_known_args()  # the rest: train_ppo.py overrides, e.g. --distill.coef 0.5
    work = Path(args.work)
    prepare(work)
    actor, data = student(work, args.student_steps), work / "data"
    out = work / f"distill-{args.mode}{'-reward' if args.reward else ''}{f'-lmbda{args.lmbda:g}' * (args.lmbda < 1)}"
    overrides = {
        "actor.path": actor, "distill.teacher": work / "sft" / "model", "distill.mode": args.mode,
        "judge.reward_model.path": work / "rm" / "model", "data.prompts": data / "prompts_train.parquet",
        "data.eval_prompts": data / "prompts_validation.parquet", "train.iterations": args.iterations,
        "train.eval_every": args.iterations, "checkpoint.every_steps": 0, "logging.output_dir": out,
    }  # fmt: skip
    if args.lmbda < 1:
        overrides |= {"distill.lmbda": args.lmbda, "data.prompts": with_responses(data)}
    flags = [a for key, value in overrides.items() for a in (f"--{key}", str(value))] + QUIET + extra
    if args.reward:
        rm = json.dumps({"path": str(work / "rm" / "model"), "normalize": True})
        flags += ["--reward_model", rm, "--rewards.clip", "5.0"]
    run([sys.executable, "train/train_ppo.py", "--config", CONFIG, *flags, "--overwrite"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0], next(r for r in reversed(rows) if "eval/distill/reverse_kl" in r)
    seconds = statistics.mean([r["timing/iteration_s"] for r in rows if "timing/iteration_s" in r][1:])
    kl = (first["eval/distill/reverse_kl"], last["eval/distill/reverse_kl"])
    on_policy = [r["distill/on_policy"] for r in rows if "distill/on_policy" in r]
    print(
        f"{args.mode} distillation{' with the reward' if args.reward else ''}"
        + (f", lmbda {args.lmbda:g} ({sum(on_policy):g} of {len(on_policy)} iterations sampled)" if on_policy else "")
        + f", student = {args.student_steps} SFT "
        f"steps, teacher = the demo's SFT model, {args.iterations} iterations ({seconds:.2f} s/iteration, iterations "
        f"2-{args.iterations}):\n"
        f"  held-out reverse KL to the teacher per token {kl[0]:.3f} -> {kl[1]:.3f} ({1 - kl[1] / kl[0]:.0%} lower)\n"
        f"  held-out judge reward (the demo's reward model) {first['eval/judge_reward']:.3f} -> "
        f"{last['eval/judge_reward']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
