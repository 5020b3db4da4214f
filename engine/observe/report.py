"""One self-contained HTML report of a run: summary, plots, events and sample rollouts.

    python -m engine.observe.report RUN_DIR [--output PATH]

Reads RUN_DIR/metrics.jsonl (required) and, when present, config.json, events.jsonl and
samples.jsonl (engine/observe/run_data.py); writes RUN_DIR/report.html (or PATH) and its PNG
plots (engine/observe/plots.py) into a ``report/`` folder beside it, linked relatively. A run
still writing renders too (a half-written last line is left out), and non-finite metric values
are skipped in the plots.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from engine.observe.plots import EXPECTED_PLOTS, Plot, expected_plots, render_plots
from engine.observe.run_data import Records, Run, load_run, series

# EXPECTED_PLOTS and expected_plots are re-exported: the training scripts' tests import them from here.
__all__ = ["EXPECTED_PLOTS", "build_html", "expected_plots", "main", "write_report"]

HEADLINE = {
    "sft": ("sft/loss", "eval/loss", "eval/perplexity"),
    "rm": ("eval/acc", "eval/loss_total"),
    "ppo": ("ppo/score", "ppo/kl", "eval/reward", "eval/win_rate"),
    "dpo": ("eval/acc", "eval/margin", "eval/loss", "eval/kl"),
}
ERROR_EVENTS = ("nonfinite_abort", "rollback_give_up")
SAMPLE_ROWS = 4

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
