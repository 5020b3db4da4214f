"""The report's PNG plots: which metrics go on which plot for each run kind, drawn with matplotlib.

A plot none of whose keys was logged (or whose values are all non-finite) is left out.
``EXPECTED_PLOTS[kind]`` names the plots a complete run of a kind always has: every SFT and RM
plot, and every PPO plot except ``win_rate.png`` and ``monitors.png``, which come from evaluation
against the reference policy and so are missing from a run without eval prompts, ``distill.png``,
which only a run with a teacher (the ``distill`` section) has, and ``episodes.png``, which only a
multi-turn run (``rollout.environment``) has.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from engine.observe.records import read_records
from engine.observe.run_data import Records, Run, finite, keys_with_prefix, run_kind, series

# Vertical lines on the PPO reward plot: event kind -> (colour, line style).
MARKED_EVENTS = {"rollback": ("black", ":"), "rollback_give_up": ("black", "-"), "kl_guard": ("magenta", ":")}


def kl_ceiling(config: dict[str, Any] | None) -> float | None:
    guards = (config or {}).get("guards")
    value = guards.get("kl_ceiling") if isinstance(guards, dict) else None
    return float(value) if finite(value) else None


# ---- plot families: each draws into a Figure and says whether it found any data ----


def _line(ax: Axes, records: Records, key: str, label: str | None = None, **style: Any) -> bool:
    steps, values = series(records, key)
    if steps:
        sparse: dict[str, Any] = {"marker": "o", "markersize": 3} if key.startswith("eval/") else {}
        ax.plot(steps, values, label=label or key, **(sparse | style))
    return bool(steps)


def _finish(ax: Axes, ylabel: str = "") -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _lines(
    *patterns: str, ylabel: str = "", hline: float | None = None, skip_suffixes: tuple[str, ...] = ()
) -> Callable[[Figure, Run], bool]:
    """A plot of the given keys (``prefix*``: every key with that prefix, but those ending in one of
    ``skip_suffixes``) on one axis, with an optional dashed reference line."""

    def draw(fig: Figure, run: Run) -> bool:
        ax = fig.add_subplot()
        keys = [k for p in patterns for k in (keys_with_prefix(run.metrics, p[:-1]) if p.endswith("*") else [p])]
        keys = [k for k in keys if not (skip_suffixes and k.endswith(skip_suffixes))]
        drawn = [_line(ax, run.metrics, key) for key in keys]
        if hline is not None:
            ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
        _finish(ax, ylabel)
        return any(drawn)

    return draw


def plot_rm_accuracy(fig: Figure, run: Run) -> bool:
    ax = fig.add_subplot()
    drawn = [
        _line(ax, run.metrics, "rm/acc", color="black"),
        _line(ax, run.metrics, "eval/acc", color="black", linestyle="--"),
    ]
    for i, key in enumerate(keys_with_prefix(run.metrics, "rm/acc_")):
        component = key.removeprefix("rm/acc_")
        drawn.append(_line(ax, run.metrics, key, color=f"C{i}", alpha=0.6))
        drawn.append(_line(ax, run.metrics, f"eval/acc_{component}", color=f"C{i}", linestyle="--"))
    ax.axhline(0.5, color="grey", linestyle=":", linewidth=1)
    _finish(ax, "pairwise accuracy")
    return any(drawn)


def plot_lr_grad_norm(fig: Figure, run: Run) -> bool:
    top, bottom = fig.subplots(2, 1, sharex=True)
    drawn = [_line(top, run.metrics, f"{run.kind}/lr"), _line(bottom, run.metrics, f"{run.kind}/grad_norm", color="C1")]
    _finish(top, "learning rate")
    _finish(bottom, "grad norm")
    top.set_xlabel("")
    return any(drawn)


def plot_ppo_reward(fig: Figure, run: Run) -> bool:
    ax = fig.add_subplot()
    keys = ("ppo/score", "eval/reward", "eval/reward_greedy", "eval/ref_reward")
    drawn = [_line(ax, run.metrics, key) for key in keys]
    for kind, (color, style) in MARKED_EVENTS.items():
        for i, step in enumerate(sorted({e["step"] for e in run.events if e.get("event") == kind})):
            ax.axvline(step, color=color, linestyle=style, linewidth=1.2, label=kind if i == 0 else None)
    _finish(ax, "reward")
    return any(drawn)


def plot_kl_vs_reward(fig: Figure, run: Run) -> bool:
    ax = fig.add_subplot()
    points = [r for r in run.metrics if finite(r.get("ppo/kl")) and finite(r.get("ppo/score"))]
    if points:
        kl, score, steps = ([r[k] for r in points] for k in ("ppo/kl", "ppo/score", "step"))
        scatter = ax.scatter(kl, score, c=steps, s=12, cmap="viridis", label="rollouts (ppo/kl, ppo/score)")
        fig.colorbar(scatter, ax=ax, label="step")
    curve = [r for r in run.metrics if finite(r.get("eval/kl")) and finite(r.get("eval/reward"))]
    if curve:
        ax.plot(
            [r["eval/kl"] for r in curve],
            [r["eval/reward"] for r in curve],
            "o-",
            color="C3",
            label="eval: RM score vs KL",
        )
    _finish(ax, "reward")
    ax.set_xlabel("KL to reference (per sequence)")
    return bool(points or curve)


def plot_kl(fig: Figure, run: Run) -> bool:
    ax = fig.add_subplot()
    drawn = [_line(ax, run.metrics, "ppo/kl_per_token"), _line(ax, run.metrics, "eval/kl_per_token")]
    ceiling = kl_ceiling(run.config)
    if ceiling is not None:
        ax.axhline(ceiling, color="C3", linestyle="--", linewidth=1, label=f"kl_ceiling {ceiling:g}")
    coef = ax.twinx()
    _line(coef, run.metrics, "ppo/kl_coef", color="C2", alpha=0.7)
    coef.set_ylabel("kl_coef")
    _finish(ax, "KL per token")
    return any(drawn)


PHASES = ("timing/generate_s", "timing/score_s", "timing/make_experience_s", "timing/train_s", "timing/sync_s")


def plot_phase_time(fig: Figure, run: Run) -> bool:
    ax = fig.add_subplot()
    rows = [r for r in run.metrics if any(finite(r.get(k)) for k in PHASES)]
    if rows:
        stacks = [[r[k] if finite(r.get(k)) else 0.0 for r in rows] for k in PHASES]
        ax.stackplot([r["step"] for r in rows], stacks, labels=[k.removeprefix("timing/") for k in PHASES], alpha=0.8)
        _line(
            ax, run.metrics, "timing/iteration_s", label="iteration (total)", color="black", linestyle="--", linewidth=1
        )
    _finish(ax, "seconds per step")
    return bool(rows)


class Plot(NamedTuple):
    file: str
    title: str
    draw: Callable[[Figure, Run], bool]
    only: str | None = None  # drawn for some runs only: with "eval" prompts, a "distill" teacher, "episodes"


PLOTS: dict[str, tuple[Plot, ...]] = {
    "sft": (
        Plot(
            "loss.png",
            "Loss on assistant tokens (eval: held-out)",
            _lines("sft/loss", "eval/loss", ylabel="nats/token"),
        ),
        Plot("lr_grad_norm.png", "Learning rate and gradient norm", plot_lr_grad_norm),
        Plot("throughput.png", "Throughput", _lines("timing/tokens_per_s", ylabel="tokens/s")),
    ),
    "rm": (
        Plot("loss.png", "Loss", _lines("rm/loss_total", "eval/loss_total", ylabel="loss")),
        Plot("accuracy.png", "Accuracy (dashed: eval)", plot_rm_accuracy),
        Plot("margin.png", "Margin (chosen - rejected reward)", _lines("rm/margin", "eval/margin", ylabel="margin")),
        Plot("lr_grad_norm.png", "Learning rate and gradient norm", plot_lr_grad_norm),
        Plot("throughput.png", "Throughput", _lines("timing/tokens_per_s", ylabel="tokens/s")),
    ),
    "dpo": (
        Plot("loss.png", "Loss (eval: held-out)", _lines("dpo/loss", "eval/loss", ylabel="loss")),
        Plot("accuracy.png", "Implicit-reward accuracy", _lines("dpo/acc", "eval/acc", ylabel="accuracy", hline=0.5)),
        Plot(
            "rewards.png",
            "Implicit rewards",
            _lines("dpo/chosen_reward", "dpo/rejected_reward", "dpo/margin", "eval/margin", ylabel="reward", hline=0.0),
        ),
        Plot("logps.png", "Response log-probs", _lines("dpo/chosen_logp", "dpo/rejected_logp", ylabel="nats")),
        Plot("kl.png", "KL to the reference (held-out)", _lines("eval/kl", ylabel="nats/token"), only="eval"),
        Plot("lr_grad_norm.png", "Learning rate and gradient norm", plot_lr_grad_norm),
        Plot("throughput.png", "Throughput", _lines("timing/tokens_per_s", ylabel="tokens/s")),
    ),
    "ppo": (
        Plot("reward.png", "Reward", plot_ppo_reward),
        Plot(
            "reward_components.png",
            "Reward components",
            _lines("reward/*", ylabel="reward", skip_suffixes=("/errors", "/timeouts")),
        ),
        Plot("kl_vs_reward.png", "KL vs reward", plot_kl_vs_reward),
        Plot("kl.png", "KL over time", plot_kl),
        Plot("entropy.png", "Entropy", _lines("ppo/entropy", ylabel="nats/token")),
        Plot("value_loss.png", "Value loss", _lines("ppo/vf_loss", ylabel="loss")),
        Plot("clipfrac.png", "Clip fraction", _lines("ppo/clipfrac", "ppo/vf_clipfrac", ylabel="fraction")),
        Plot(
            "response_length.png",
            "Response length",
            _lines(
                "ppo/response_length",
                "eval/reward_length",
                "eval/reward_greedy_length",
                "eval/ref_length",
                ylabel="tokens",
            ),
        ),
        Plot("phase_time.png", "Time per phase", plot_phase_time),
        Plot("tokens_per_s.png", "Generation throughput", _lines("timing/generated_tokens_per_s", ylabel="tokens/s")),
        Plot(
            "win_rate.png",
            "Win rate vs reference",
            _lines("eval/win_rate", "eval/judge_win_rate*", ylabel="win rate", hline=0.5),
            only="eval",
        ),
        Plot(
            "monitors.png",
            "Reward-hacking monitors",
            _lines("eval/length_ratio", "eval/repeated_ngram_frac", "eval/distinct_ratio"),
            only="eval",
        ),
        Plot(
            "distill.png",
            "Distillation: reverse KL to the teacher, the teacher's log-prob of the samples",
            _lines(
                "distill/reverse_kl",
                "eval/distill/reverse_kl",
                "distill/jsd",
                "distill/teacher_logprob",
                ylabel="nats/token",
                hline=0.0,
            ),
            only="distill",
        ),
        Plot(
            "episodes.png",
            "Multi-turn episodes: the policy's turns, the environment's counts (tool calls and their errors), "
            "the observations' share of the tokens",
            _lines("ppo/turns", "environment/*", "ppo/observation_share", ylabel="per episode / share"),
            only="episodes",
        ),
    ),
    "unknown": (),
}
EXPECTED_PLOTS = {kind: [p.file for p in plots if p.only is None] for kind, plots in PLOTS.items()}


def expected_plots(run_dir: str) -> list[str]:
    """The PNG files a complete run of this run's kind must produce."""
    return EXPECTED_PLOTS[run_kind(read_records(os.path.join(run_dir, "metrics.jsonl")))]


def mark_flags(fig: Figure, events: Records) -> None:
    """A shaded band on every axis over steps, from where each reward-hacking flag's check started
    (the event's ``since``: the previous check) to its step."""
    flags = [e for e in events if str(e.get("event", "")).startswith("monitor/") and finite(e.get("step"))]
    label: str | None = "reward-hacking flag"  # once: the figure's legend gathers every axis' labels
    for ax in (a for a in fig.axes if a.get_xlabel() == "step"):
        for e in flags:
            since = e.get("since")
            start = min(float(since) if finite(since) else e["step"], e["step"] - 0.5)
            ax.axvspan(start, e["step"], color="orange", alpha=0.2, label=label)
            label = None


def render_plots(run: Run, png_dir: str) -> list[tuple[Plot, str]]:
    """Saves every plot that has data; returns (plot, png path) pairs."""
    os.makedirs(png_dir, exist_ok=True)
    written = []
    for plot in PLOTS[run.kind]:
        fig = Figure(figsize=(9, 3.8), layout="constrained")
        FigureCanvasAgg(fig)
        if plot.draw(fig, run):
            mark_flags(fig, run.events)
            fig.suptitle(plot.title)
            fig.legend(loc="outside right upper", fontsize="small")  # gathers every axis' labelled lines
            path = os.path.join(png_dir, plot.file)
            fig.savefig(path, dpi=100)
            written.append((plot, path))
    return written
