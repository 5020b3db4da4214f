"""One self-contained HTML report of a run: summary, plots, events and sample rollouts.

    python -m engine.observe.report RUN_DIR [--output PATH]

Reads RUN_DIR/metrics.jsonl (required) and, when present, config.json, events.jsonl and
samples.jsonl; writes RUN_DIR/report.html (or PATH) and its PNG plots into a ``report/``
folder beside it, linked relatively. A run still writing renders too (a half-written last
line is left out), and non-finite metric values are skipped in the plots.

The run kind is "sft", "rm" or "ppo" when a metric key starts with ``sft/``, ``rm/`` or ``ppo/``.
A plot none of whose keys was logged is left out. ``EXPECTED_PLOTS[kind]`` names
the plots a complete run of a kind always has: every SFT and RM plot, and every PPO plot except
``win_rate.png`` and ``monitors.png``, which come from evaluation against the reference
policy and so are missing from a run without eval prompts.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeGuard

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from engine.observe.records import read_records

Records = list[dict[str, Any]]
HEADLINE = {
    "sft": ("sft/loss", "eval/loss", "eval/perplexity"),
    "rm": ("eval/acc", "eval/loss_total"),
    "ppo": ("ppo/score", "ppo/kl", "eval/reward", "eval/win_rate"),
}
# Vertical lines on the PPO reward plot: event kind -> (colour, line style).
MARKED_EVENTS = {"rollback": ("black", ":"), "rollback_give_up": ("black", "-"), "kl_guard": ("magenta", ":")}
ERROR_EVENTS = ("nonfinite_abort", "rollback_give_up")
SAMPLE_ROWS = 4


@dataclass
class Run:
    metrics: Records
    config: dict[str, Any] | None
    events: Records
    samples: Records
    kind: str


def _finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and math.isfinite(value)


def series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key, finite values only."""
    points = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def keys_with_prefix(records: Records, prefix: str) -> list[str]:
    return sorted({k for r in records for k in r if k.startswith(prefix)})


def kl_ceiling(config: dict[str, Any] | None) -> float | None:
    guards = (config or {}).get("guards")
    value = guards.get("kl_ceiling") if isinstance(guards, dict) else None
    return float(value) if _finite(value) else None


def run_kind(records: Records) -> str:
    """The run kind: sft, rm, ppo, or unknown (e.g. a PPO run that has only logged its step-0 eval)."""
    keys = {k for r in records for k in r}
    return next((kind for kind in ("sft", "rm", "ppo") if any(k.startswith(kind + "/") for k in keys)), "unknown")


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


def _lines(*patterns: str, ylabel: str = "", hline: float | None = None) -> Callable[[Figure, Run], bool]:
    """A plot of the given keys (``prefix*``: every key with that prefix) on one axis, with an
    optional dashed reference line."""

    def draw(fig: Figure, run: Run) -> bool:
        ax = fig.add_subplot()
        keys = [k for p in patterns for k in (keys_with_prefix(run.metrics, p[:-1]) if p.endswith("*") else [p])]
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
    points = [r for r in run.metrics if _finite(r.get("ppo/kl")) and _finite(r.get("ppo/score"))]
    if points:
        kl, score, steps = ([r[k] for r in points] for k in ("ppo/kl", "ppo/score", "step"))
        scatter = ax.scatter(kl, score, c=steps, s=12, cmap="viridis", label="rollouts (ppo/kl, ppo/score)")
        fig.colorbar(scatter, ax=ax, label="step")
    curve = [r for r in run.metrics if _finite(r.get("eval/kl")) and _finite(r.get("eval/reward"))]
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


PHASES = ("timing/generate_s", "timing/make_experience_s", "timing/train_s", "timing/sync_s")


def plot_phase_time(fig: Figure, run: Run) -> bool:
    ax = fig.add_subplot()
    rows = [r for r in run.metrics if any(_finite(r.get(k)) for k in PHASES)]
    if rows:
        stacks = [[r[k] if _finite(r.get(k)) else 0.0 for r in rows] for k in PHASES]
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
    eval_only: bool = False


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
    "ppo": (
        Plot("reward.png", "Reward", plot_ppo_reward),
        Plot("reward_components.png", "Reward components", _lines("ppo/rm_*", "ppo/rule_*", ylabel="reward")),
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
            _lines("eval/win_rate", ylabel="win rate", hline=0.5),
            eval_only=True,
        ),
        Plot(
            "monitors.png",
            "Reward-hacking monitors",
            _lines("eval/length_ratio", "eval/repeated_ngram_frac"),
            eval_only=True,
        ),
    ),
    "unknown": (),
}
EXPECTED_PLOTS = {kind: [p.file for p in plots if not p.eval_only] for kind, plots in PLOTS.items()}


def expected_plots(run_dir: str) -> list[str]:
    """The PNG files a complete run of this run's kind must produce."""
    return EXPECTED_PLOTS[run_kind(read_records(os.path.join(run_dir, "metrics.jsonl")))]


def load_run(run_dir: str) -> Run:
    def optional(name: str) -> Records:
        path = os.path.join(run_dir, name)
        return read_records(path) if os.path.exists(path) else []

    metrics = read_records(os.path.join(run_dir, "metrics.jsonl"))
    config_path = os.path.join(run_dir, "config.json")
    config = None
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = json.load(f)
    return Run(metrics, config, optional("events.jsonl"), optional("samples.jsonl"), run_kind(metrics))


def render_plots(run: Run, png_dir: str) -> list[tuple[Plot, str]]:
    """Saves every plot that has data; returns (plot, png path) pairs."""
    os.makedirs(png_dir, exist_ok=True)
    written = []
    for plot in PLOTS[run.kind]:
        fig = Figure(figsize=(9, 3.8), layout="constrained")
        FigureCanvasAgg(fig)
        if plot.draw(fig, run):
            fig.suptitle(plot.title)
            fig.legend(loc="outside right upper", fontsize="small")  # gathers every axis' labelled lines
            path = os.path.join(png_dir, plot.file)
            fig.savefig(path, dpi=100)
            written.append((plot, path))
    return written


# ---- HTML ----

CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}\n"
    "table{border-collapse:collapse;margin:.5em 0}"
    "td,th{border:1px solid #ccc;padding:.25em .5em;vertical-align:top;text-align:left}\n"
    "th{background:#f3f3f3}tr.warn{background:#fff4d6}tr.error{background:#fde0e0}\n"
    "td div{white-space:pre-wrap;max-height:12em;overflow:auto;max-width:32em}\n"
    "figure{display:inline-block;margin:.5em}figcaption{font-size:.9em;color:#555}"
    "pre{background:#f7f7f7;padding:.5em;overflow:auto}"
)


def _e(value: Any) -> str:
    return html.escape(f"{value:.4g}" if isinstance(value, float) else str(value))


def _table(header: Sequence[str], rows: Sequence[tuple[str, Sequence[Any]]]) -> str:
    """rows: (css class, cells); no header row when ``header`` is empty."""
    head = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join(
        f'<tr class="{cls}">' + "".join(f"<td><div>{_e(c)}</div></td>" for c in cells) + "</tr>" for cls, cells in rows
    )
    return f"<table>{head}{body}</table>"


def summary_html(run: Run) -> str:
    steps = [r["step"] for r in run.metrics]
    rows: list[tuple[str, tuple[str, Any]]] = [
        ("", ("run kind", run.kind)),
        ("", ("steps logged", f"{len(steps)} (last step {steps[-1]})" if steps else "0")),
    ]
    for key in HEADLINE.get(run.kind, ()):
        values = series(run.metrics, key)[1]
        rows.append(("", (f"last {key}", values[-1] if values else "-")))
    for kind, count in sorted(Counter(e.get("event", "?") for e in run.events).items()):
        rows.append(("warn" if kind.startswith("monitor/") else "", (f"events: {kind}", count)))
    return _table((), rows)


def events_html(events: Records) -> str:
    def css(kind: str) -> str:
        return "warn" if kind.startswith("monitor/") else "error" if kind in ERROR_EVENTS else ""

    rows = []
    for e in events:
        extra = {k: v for k, v in e.items() if k not in ("step", "event", "message")}
        rows.append(
            (
                css(str(e.get("event", ""))),
                (e.get("step"), e.get("event"), e.get("message", ""), json.dumps(extra) if extra else ""),
            )
        )
    return _table(("step", "event", "message", "details"), rows) if rows else "<p>No events.</p>"


def samples_html(samples: Records) -> str:
    steps = sorted({s["step"] for s in samples})
    if not steps:
        return "<p>No samples.</p>"
    picked = sorted({steps[0], steps[len(steps) // 2], steps[-1]})
    columns = ("step", "prompt", "response", "reward", "kl", "ref_response", "ref_reward")
    rows = [
        ("", [row.get(c, "") for c in columns])
        for step in picked
        for row in [s for s in samples if s["step"] == step][:SAMPLE_ROWS]
    ]
    return _table(columns, rows)


def build_html(run: Run, run_dir: str, plots: list[tuple[Plot, str]], html_dir: str) -> str:
    figures = "".join(
        f'<figure><img src="{_e(os.path.relpath(path, html_dir).replace(os.sep, "/"))}" alt="{_e(plot.title)}">'
        f"<figcaption>{_e(plot.title)}</figcaption></figure>"
        for plot, path in plots
    )
    config = (
        f"<pre>{_e(json.dumps(run.config, indent=2))}</pre>" if run.config is not None else "<p>No config.json.</p>"
    )
    sections = [
        f"<h1>Run report: {_e(os.path.abspath(run_dir))}</h1>",
        summary_html(run),
        "<h2>Plots</h2>" + (figures or "<p>No plottable metrics yet.</p>"),
        "<h2>Events and flags</h2>" + events_html(run.events),
    ]
    if run.kind == "ppo" or run.samples:
        sections.append("<h2>Sample rollouts</h2>" + samples_html(run.samples))
    sections.append(f"<h2>Config</h2><details><summary>config.json</summary>{config}</details>")
    body = "\n".join(sections)
    title = _e(os.path.basename(os.path.abspath(run_dir)))
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>Run report: {title}</title>'
        f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def write_report(run_dir: str, output: str | None = None) -> str:
    """Writes the report (default RUN_DIR/report.html, PNGs in report/ beside it); returns its path."""
    output = output or os.path.join(run_dir, "report.html")
    html_dir = os.path.dirname(os.path.abspath(output))
    run = load_run(run_dir)
    plots = render_plots(run, os.path.join(html_dir, "report"))
    with open(output, "w") as f:
        f.write(build_html(run, run_dir, plots, html_dir))
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--output", help="HTML path (default RUN_DIR/report.html); PNGs go to report/ beside it")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.run_dir, "metrics.jsonl")):
        print(f"error: {args.run_dir}: no metrics.jsonl", file=sys.stderr)
        return 2
    try:
        path = write_report(args.run_dir, args.output)
    except json.JSONDecodeError as e:
        print(f"error: {args.run_dir}: unreadable jsonl or config ({e})", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
