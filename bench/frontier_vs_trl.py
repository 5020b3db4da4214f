"""The reward-KL frontier: true score against KL to the SFT model, train/train_ppo.py vs TRL 1.12's PPOTrainer.

    python bench/frontier_vs_trl.py [--task demo|lists] [--work runs/frontier] [--kl-coefs 0.005 0.02 0.05 0.1 0.3 1.0]
                                    [--seeds 0 1 2] [--iterations 40] [--variant LABEL=OVERRIDES ...] [--text-rm]
                                    [--no-trl] [--report-only] [--plot PATH] [--peer-venv bench/.peer-trl112]

The demo's synthetic task (data_prep/synthetic_task.py knows its rule): the demo's SFT model and
reward model (``make demo``'s stages, run once into WORK/demo); or ``--task lists``, the list task
with its often wrong reward model (bench/frontier_tasks.py, built once into WORK/lists, where its
runs are kept too). Then per fixed KL coefficient and seed a PPO run from the SFT model on the
task's training prompts: 16 prompts x 4 samples x 24 new tokens per iteration, 2 mini-batches, one
epoch, lr 3e-4, clip 0.2, GAE (gamma 1, lambda 0.95), value model from the reward model, the same
prompts in the same order for both trainers.

- ours: ds_configs/demo_ppo.json with ``ppo.kl_target`` null (a fixed coefficient), no evaluation,
  rollback or checkpoint; ``--variant LABEL=OVERRIDES`` adds a run set with train_ppo.py overrides
  (``--variant "no whitening=--ppo.whiten_advantages false"``): the ablations; ``--text-rm`` adds
  ours with a reward model that reads each response as decoded text rendered again through the
  chat template instead of the sampled ids (bench/frontier_tasks.text_reading_reward_model);
- TRL: bench/peers/trl_ppo.py, its defaults except the settings above (its reward: the same reward
  model, weighted and standardised as ours reads it).

Every final policy is measured the same way, by bench/frontier_eval.py (held-out prompts, 32 samples
each: the rule's true score and the KL per token to the SFT model). Two references come from 128
samples of the SFT model per held-out prompt (bench/frontier_references.py): best-of-n ranked by
the reward model, and the optimum of the objective PPO maximises, E[r] - beta KL; their n = 1 is
the SFT model's score every gain is counted from. Runs are kept in WORK and not repeated (a stopped
sweep continues). Prints each run, then per trainer and reference the true score gain over the SFT
model interpolated at matched KL per token (each seed's points, then their mean), each variant's
against ours on the same runs, and plots the gains against KL.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from frontier_tasks import TASKS, task_models, text_reading_reward_model
from ppo_vs_trl import prompts_in_draw_order, run_demo_ppo
from rm_vs_trl import REPO, ensure_peer_venv, run

TRL_PPO_VERSION = "1.12.0"
TRL = f"TRL {TRL_PPO_VERSION}"
MATCHED_KL = (0.05, 0.1, 0.15, 0.3)
SAMPLES_PER_PROMPT, MINI_BATCHES, LR = 4, 2, 3e-4  # ds_configs/demo_ppo.json's


def train_ours(demo: Path, out: Path, kl_coef: float, seed: int, iterations: int, overrides: list[str]) -> Path:
    run_demo_ppo(
        [
            *("--actor.path", str(demo / "sft" / "model"), "--reward_model.path", str(demo / "rm" / "model")),
            *("--data.prompts", str(demo / "data" / "prompts_train.parquet"), "--data.eval_prompts", ""),
            *("--ppo.kl_coef", str(kl_coef), "--ppo.kl_target", "null", "--train.seed", str(seed)),
            *("--train.iterations", str(iterations), "--train.eval_every", "0", "--guards.rollback_drop", "null"),
            *("--checkpoint.every_steps", "0", "--logging.wandb", "false", "--logging.tensorboard", "false"),
            *("--logging.progress_bar", "false", "--logging.output_dir", str(out), "--overwrite", *overrides),
        ]
    )
    return out / "actor"


def train_trl(demo: Path, out: Path, kl_coef: float, seed: int, iterations: int, peer_python: Path) -> Path:
    prompts = prompts_in_draw_order(
        demo / "data" / "prompts_train.parquet", seed, iterations, out.parent / f"prompts-seed{seed}.parquet"
    )
    run(
        [
            str(peer_python),
            "bench/peers/trl_ppo.py",
            *("--actor", str(demo / "sft" / "model"), "--reward", str(demo / "rm" / "model")),
            *("--prompts", str(prompts), "--out", str(out / "trainer"), "--save", str(out / "actor")),
            *("--iterations", str(iterations), "--new-tokens", "24", "--samples-per-prompt", str(SAMPLES_PER_PROMPT)),
            *("--num-mini-batches", str(MINI_BATCHES), "--micro-batch", "16", "--learning-rate", str(LR)),
            *("--kl-coef", str(kl_coef), "--seed", str(seed)),
        ],
        WANDB_MODE="disabled",
    )
    return out / "actor"


def measure(demo: Path, policy: Path, task: str) -> dict:
    """bench/frontier_eval.py's JSON line for ``policy``."""
    line = run(
        [
            sys.executable,
            "bench/frontier_eval.py",
            *("--policy", str(policy), "--sft", str(demo / "sft" / "model")),
            *("--prompts", str(demo / "data" / "prompts_validation.parquet"), "--samples-per-prompt", "32"),
            *("--task", task),
        ],
        PYTHONPATH=str(REPO),
    ).splitlines()[-1]
    return json.loads(line)


def reference_points(demo: Path, ensemble: list[str], task: str) -> str:
    """bench/frontier_references.py's JSON lines: best-of-n and the KL-regularised optimum (from SFT
    samples), by the reward model and, with ``ensemble`` (more reward models), by the members' mean."""
    out = run(
        [
            sys.executable,
            "bench/frontier_references.py",
            *("--sft", str(demo / "sft" / "model"), "--reward-model", str(demo / "rm" / "model")),
            *("--prompts", str(demo / "data" / "prompts_validation.parquet"), "--task", task),
            *(["--ensemble", *ensemble] if ensemble else []),
        ],
        PYTHONPATH=str(REPO),
    )
    return "".join(line + "\n" for line in out.splitlines() if line.startswith("{"))


def reference_gains(lines: list[dict], sft_score: float) -> dict[str, list[tuple[float, float]]]:
    """Per reference, "best-of-n (<reward>)" and "KL-regularised optimum (<reward>)", its (KL per token,
    true score gain over the SFT model) points: the reward model's ("rm") first, then the ensemble's."""
    return {
        f"{kind} ({reward})": sorted(
            (p["kl_per_token"], p["score"] - sft_score) for p in lines if key in p and p["reward"] == reward
        )
        for reward in dict.fromkeys(p["reward"] for p in lines)
        for kind, key in (("best-of-n", "n"), ("KL-regularised optimum", "beta"))
    }


def at_matched_kl(points: list[tuple[float, float]], kl: float) -> float | None:
    """The score at ``kl`` on the line through one seed's (KL, score) points; None outside them."""
    kls, scores = zip(*sorted(points))
    return float(np.interp(kl, kls, scores)) if kls[0] <= kl <= kls[-1] else None


def matched_gains(runs: dict[tuple[float, int], dict], sft_score: float, kl: float) -> list[float | None]:
    """Each seed's true score gain over the SFT model at ``kl``, on the line through its runs (None outside)."""
    seeds = sorted({s for _, s in runs})
    points = [[(r["kl_per_token"], r["score"]) for (_, s), r in runs.items() if s == seed] for seed in seeds]
    return [None if (score := at_matched_kl(p, kl)) is None else score - sft_score for p in points]


def gain_cell(gains: list[float | None]) -> str:
    """``mean [seed/seed/...]``; the mean only when every seed reaches the KL."""
    mean = f"{statistics.mean(gains):.3f}" if None not in gains else "-"
    return f"{mean} [{'/'.join('-' if g is None else f'{g:.2f}' for g in gains)}]"


def report(
    results: dict[str, dict[tuple[float, int], dict]],
    sft: dict,
    references: dict[str, list[tuple[float, float]]],
    plot: Path | None,
) -> None:
    """The runs, then the score gain over the SFT model at matched KL per token per trainer, and
    the references' (:func:`reference_gains`)."""
    results = {label: runs for label, runs in results.items() if runs}  # a trainer not run: no row
    print(f"SFT model (the references' samples): true score {sft['score']:.3f}, {sft['response_tokens']:.1f} tokens")
    print(
        f"{'trainer':<40}{'kl_coef':>8}{'seed':>5}{'KL/token':>10}{'score':>8}{'gain/sqrt(KL)':>15}{'tokens':>8}{'min':>6}"
    )
    for label, runs in results.items():
        for (coef, seed), r in sorted(runs.items()):
            gain = (r["score"] - sft["score"]) / max(r["kl_per_token"], 1e-9) ** 0.5
            print(
                f"{label:<40}{coef:>8g}{seed:>5}{r['kl_per_token']:>10.4f}{r['score']:>8.3f}{gain:>15.2f}"
                f"{r['response_tokens']:>8.1f}{r['train_s'] / 60:>6.1f}"
            )
    print("true score gain over the SFT model at matched KL per token: mean of seeds [each seed]")
    print(f"{'trainer':<40}" + "".join(f"{'KL ' + str(kl):>28}" for kl in MATCHED_KL))
    gains = {label: [matched_gains(runs, sft["score"], kl) for kl in MATCHED_KL] for label, runs in results.items()}
    for label, cells in gains.items():
        print(f"{label:<40}" + "".join(f"{gain_cell(g):>28}" for g in cells))
    for label, curve in references.items():
        ref = [[at_matched_kl([(0.0, 0.0), *curve], kl)] for kl in MATCHED_KL]
        print(f"{label:<40}" + "".join(f"{gain_cell(g):>28}" for g in ref))
        if "ours" in gains:
            cells = [ratio_cell(o, r * len(o)) for o, r in zip(gains["ours"], ref)]
            print(f"{'ours / ' + label:<40}" + "".join(f"{c:>28}" for c in cells))
    for label, runs in results.items():  # each trainer against TRL on the same seeds, seed by seed
        if label != TRL and (base := {k: r for k, r in results.get(TRL, {}).items() if k[1] in {s for _, s in runs}}):
            ratios = [
                ratio_cell(gains[label][i], matched_gains(base, sft["score"], kl)) for i, kl in enumerate(MATCHED_KL)
            ]
            print(f"{label + ' / TRL':<40}" + "".join(f"{r:>28}" for r in ratios))
    for label, runs in results.items():  # the ablations: each against ours on the same coefficients and seeds
        if label not in ("ours", TRL) and (
            base := {k: results["ours"][k] for k in runs if k in results.get("ours", {})}
        ):
            ratios = [
                ratio_cell(matched_gains(runs, sft["score"], kl), matched_gains(base, sft["score"], kl))
                for kl in MATCHED_KL
            ]
            print(f"{label + ' / ours (same runs)':<40}" + "".join(f"{r:>28}" for r in ratios))
    if plot is not None:
        plot_frontier(results, sft, references, plot)


def ratio_cell(gains: list[float | None], base: list[float | None]) -> str:
    """``mean ratio [seed/seed/...]`` of two trainers' gains at one KL (the mean where every seed reaches it)."""
    ratios = [None if a is None or b is None else a / b for a, b in zip(gains, base)]
    known = [(a, b) for a, b in zip(gains, base) if a is not None and b is not None]
    mean = f"{sum(a for a, _ in known) / sum(b for _, b in known):.3f}x" if None not in ratios else "-"
    return f"{mean} [{'/'.join('-' if r is None else f'{r:.2f}' for r in ratios)}]"


def plot_frontier(
    results: dict[str, dict[tuple[float, int], dict]],
    sft: dict,
    references: dict[str, list[tuple[float, float]]],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, runs in results.items():
        points = ax.scatter(
            [r["kl_per_token"] for r in runs.values()],
            [r["score"] - sft["score"] for r in runs.values()],
            s=12,
            alpha=0.5,
            label=label,
        )
        means = sorted(  # per coefficient, the seeds' mean (KL, score), by KL, from the SFT model
            (
                statistics.mean(r["kl_per_token"] for (c, _), r in runs.items() if c == coef),
                statistics.mean(r["score"] - sft["score"] for (c, _), r in runs.items() if c == coef),
            )
            for coef in {c for c, _ in runs}
        )
        ax.plot(*zip((0.0, 0.0), *means), color=points.get_facecolor()[0])
    for (label, curve), style in zip(references.items(), ("k--", "k:")):  # the reward model's
        ax.plot(*zip((0.0, 0.0), *curve), style, marker=".", linewidth=1, label=label)
    ax.scatter([0], [0], marker="x", color="black", label="SFT model")
    ax.set_xlabel("KL per token to the SFT model (held-out samples)")
    ax.set_ylabel("true score gain over the SFT model")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=str(REPO / "runs" / "frontier"), help="kept between calls")
    parser.add_argument(
        "--task", choices=TASKS, default="demo", help="demo: make demo's; lists: data_prep/list_task.py"
    )
    parser.add_argument("--kl-coefs", type=float, nargs="+", default=[0.005, 0.02, 0.05, 0.1, 0.3, 1.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--variant", action="append", default=[], help='"LABEL=train_ppo.py overrides" (repeatable)')
    parser.add_argument("--no-trl", action="store_true", help="run none of TRL's (its kept runs are reported)")
    parser.add_argument("--report-only", action="store_true", help="run nothing: report the kept runs")
    parser.add_argument("--plot", help="write the score-KL plot here (.png)")
    parser.add_argument("--rm-ensemble", nargs="+", default=[], help="more reward models for the references")
    parser.add_argument(
        "--text-rm",
        action="store_true",
        help="add ours with the reward model reading each response as re-rendered text, not the sampled ids",
    )
    parser.add_argument("--peer-venv", default=str(REPO / "bench" / ".peer-trl112"))
    args = parser.parse_args()
    demo = task_models(args.task, Path(args.work).resolve() / args.task)
    work = demo.parent if args.task == "demo" else demo  # the demo's runs beside its models, as before
    trainers: dict[str, list[str] | None] = {"ours": [], TRL: None}  # label -> overrides (None: TRL)
    trainers |= {v.split("=", 1)[0]: shlex.split(v.split("=", 1)[1]) for v in args.variant}
    if args.text_rm:
        trainers["RM reads re-rendered text"] = ["--reward_model.path", str(text_reading_reward_model(demo))]
    runs_trl = not (args.no_trl or args.report_only)
    peer_python = ensure_peer_venv(Path(args.peer_venv), TRL_PPO_VERSION) if runs_trl else None
    results: dict[str, dict[tuple[float, int], dict]] = {label: {} for label in trainers}
    for seed in args.seeds:  # seed by seed: a sweep stopped early has every trainer at each point done
        for coef in args.kl_coefs:
            for label, overrides in trainers.items():
                out = work / label.replace(" ", "_") / f"kl{coef:g}-seed{seed}-it{args.iterations}"
                result = out / "result.json"
                if not result.exists() and not args.report_only and (overrides is not None or runs_trl):
                    out.mkdir(parents=True, exist_ok=True)
                    t0 = time.perf_counter()
                    if overrides is None:
                        policy = train_trl(demo, out, coef, seed, args.iterations, peer_python)  # type: ignore[arg-type]
                    else:
                        policy = train_ours(demo, out, coef, seed, args.iterations, overrides)
                    train_s = time.perf_counter() - t0
                    result.write_text(json.dumps(measure(demo, policy, args.task) | {"train_s": train_s}))
                if result.exists():
                    results[label][coef, seed] = json.loads(result.read_text())
    references = work / f"references{'-ensemble' + str(len(args.rm_ensemble) + 1) if args.rm_ensemble else ''}.jsonl"
    if not references.exists():
        references.write_text(reference_points(demo, args.rm_ensemble, args.task))
    lines = [json.loads(line) for line in references.read_text().splitlines()]
    sft = next(p for p in lines if p.get("n") == 1)  # best-of-1: the SFT model's samples
    report(results, sft, reference_gains(lines, sft["score"]), Path(args.plot) if args.plot else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
