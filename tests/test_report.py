"""engine.observe.report on small synthetic RM and PPO run dirs (no training, a few seconds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib.figure import Figure

from engine.observe import report
from engine.observe.plots import mark_flags

STEPS, EVAL_EVERY = 12, 4
COMPONENTS = ("helpful", "harmless")


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _rm_metrics() -> list[dict]:
    records = []
    for step in range(1, STEPS + 1):
        x = step / STEPS
        r = {"step": step, "rm/loss": 2.1 - x, "rm/loss_total": 0.7 - 0.3 * x, "rm/acc": 0.5 + 0.4 * x, "rm/margin": x}
        r |= {
            "rm/lr": 1e-4 * x,
            "rm/grad_norm": 1.0 + x,
            "rm/epoch": x,
            "rm/reward_mean": 0.1,
            "rm/reward_std": 0.05,
            "rm/center": 0.0,
        }
        r |= {"timing/step_s": 0.3, "timing/tokens_per_s": 6000.0 + 100 * step, "guard/nonfinite_skipped": 0.0}
        for c in COMPONENTS:
            r |= {f"rm/acc_{c}": 0.5 + 0.3 * x, f"rm/loss_{c}": 0.7 - 0.2 * x, f"rm/reward_mean_{c}": 0.1}
        if step % EVAL_EVERY == 0:
            r |= {
                "eval/acc": 0.5 + 0.35 * x,
                "eval/loss_total": 0.7 - 0.25 * x,
                "eval/margin": x,
                "eval/reward_mean": 0.1,
                "eval/reward_std": 0.1,
            }
            r |= {f"eval/acc_{c}": 0.6 for c in COMPONENTS} | {f"eval/loss_{c}": 0.5 for c in COMPONENTS}
        records.append(r)
    records[5]["rm/loss_total"] = float("nan")  # a skipped non-finite step
    records[6]["rm/grad_norm"] = float("inf")
    return records


def _ppo_eval(step: int) -> dict:
    x = step / STEPS
    keys = {
        "reward": 0.4 + x,
        "reward_greedy": 0.8 + x,
        "reward_length": 24.0,
        "reward_greedy_length": 23.0,
        "ref_reward": 0.4,
    }
    keys |= {
        "ref_length": 24.0,
        "win_rate": 0.5 + 0.3 * x,
        "kl": 4 * x,
        "kl_per_token": 0.2 * x,
        "length_ratio": 1.0 + x,
        "repeated_ngram_frac": 0.1 * x,
    }
    return {f"eval/{k}": v for k, v in keys.items()}


def _ppo_metrics(with_eval: bool = True) -> list[dict]:
    records = [{"step": 0} | _ppo_eval(0)] if with_eval else []
    for step in range(1, STEPS + 1):
        x = step / STEPS
        r = {
            "step": step,
            "ppo/score": 0.5 + x,
            "ppo/kl": 5 * x,
            "ppo/kl_per_token": 0.2 * x,
            "ppo/kl_coef": 0.02 + 0.01 * x,
            "ppo/response_length": 24 - x,
        }
        r |= {
            "ppo/finished": 0.1,
            "ppo/entropy": 6.3 - x,
            "ppo/vf_loss": 1.5 - x,
            "ppo/vf_clipfrac": 0.2,
            "ppo/value_mean": 0.3,
        }
        r |= {
            "ppo/pg_loss": -0.02,
            "ppo/clipfrac": 0.1 * x,
            "ppo/approx_kl": 0.01,
            "ppo/actor_lr": 5e-4,
            "ppo/sampler_logprob_gap": 1e-7,
        }
        r |= {"reward/rm_helpful": 4 + x, "reward/rm_harmless": 1 + x, "reward/no_shouting": -0.1 * x}
        r |= {"reward/no_shouting/errors": 0.0, "reward/no_shouting/timeouts": 0.0}
        r |= {"timing/generate_s": 0.2, "timing/make_experience_s": 0.4, "timing/train_s": 0.7, "timing/sync_s": 0.02}
        r |= {"timing/iteration_s": 1.35, "timing/generated_tokens_per_s": 8000.0 + step}
        r |= {"guard/nonfinite_skipped": 1.0, "guard/rollbacks": 1.0, "guard/kl_guard_hits": 1.0}
        if with_eval and step % EVAL_EVERY == 0:
            r |= _ppo_eval(step)
        records.append(r)
    records[3]["ppo/score"] = float("nan")
    records[4]["ppo/kl"] = records[4]["ppo/kl_per_token"] = float("-inf")
    return records


PPO_EVENTS = [
    {"step": 3, "event": "nonfinite_skip", "message": "loss is nan; step skipped"},
    {"step": 5, "event": "kl_guard", "message": "kl 5.1 > ceiling 4"},
    {"step": 6, "event": "rollback", "message": "rolled back to step 4", "to_step": 4},
    {"step": 8, "event": "monitor/length_growth", "message": "length ratio 1.7 & rising", "since": 4},
    {"step": 8, "event": "monitor/kl_high", "message": "kl above its limit", "since": 7},
]


def _samples() -> list[dict]:
    rows = []
    for step in (0, 4, 8, 12):
        for i in range(6):
            response = "<script>alert(1)</script>" if (step, i) == (8, 0) else f"response {step}-{i}"
            rows.append(
                {"step": step, "prompt": f"prompt {step}-{i}", "response": response, "reward": 0.1 * i, "kl": 0.5}
            )
            rows[-1] |= {"ref_response": f"reference {step}-{i}", "ref_reward": 0.2} if i % 2 else {}
    return rows


def make_run(tmp_path: Path, kind: str, extras: bool = True, with_eval: bool = True) -> Path:
    run_dir = tmp_path / kind
    run_dir.mkdir()
    _write_jsonl(run_dir / "metrics.jsonl", _rm_metrics() if kind == "rm" else _ppo_metrics(with_eval))
    if extras:
        (run_dir / "config.json").write_text(
            json.dumps({"guards": {"kl_ceiling": 4.0}, "model": {"name": "tiny <model>"}})
        )
        _write_jsonl(run_dir / "events.jsonl", PPO_EVENTS if kind == "ppo" else PPO_EVENTS[:1])
        if kind == "ppo":
            _write_jsonl(run_dir / "samples.jsonl", _samples())
    return run_dir


def check_plots(html_path: Path, expected: list[str]) -> str:
    text = html_path.read_text()
    for name in expected:
        png = html_path.parent / "report" / name
        assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 5000, name
        assert f'src="report/{name}"' in text
    return text


def test_rm_report(tmp_path):
    run_dir = make_run(tmp_path, "rm")
    assert report.expected_plots(str(run_dir)) == report.EXPECTED_PLOTS["rm"]
    html_path = Path(report.write_report(str(run_dir)))
    assert html_path == run_dir / "report.html"
    text = check_plots(html_path, report.EXPECTED_PLOTS["rm"])
    assert "eval/acc" in text and "nonfinite_skip" in text and "Sample rollouts" not in text
    assert "tiny &lt;model&gt;" in text  # the config, escaped


def test_ppo_report(tmp_path):
    run_dir = make_run(tmp_path, "ppo")
    expected = report.expected_plots(str(run_dir))
    assert expected == report.EXPECTED_PLOTS["ppo"] and "win_rate.png" not in expected
    output = tmp_path / "out" / "r.html"
    output.parent.mkdir()
    text = check_plots(
        Path(report.write_report(str(run_dir), str(output))), expected + ["win_rate.png", "monitors.png"]
    )
    assert not (run_dir / "report").exists()
    for event in PPO_EVENTS:
        assert f"<div>{event['event']}</div>" in text
    assert text.count('<tr class="warn">') == 2 + 2  # the two monitor flags, in the table and in the summary counts
    assert "length ratio 1.7 &amp; rising" in text and "to_step" in text
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    shown = {f"response {s}-{i}" for s in (0, 8, 12) for i in range(4)} - {"response 8-0"}
    assert all(f"<div>{r}</div>" in text for r in shown)
    assert "response 4-0" not in text and "response 0-4" not in text  # only first/middle/last steps, 4 rows each
    assert "reference 0-1" in text


def test_reward_hacking_flags_are_bands_on_every_step_axis():
    fig = Figure()
    steps, other = fig.subplots(1, 2)
    steps.set_xlabel("step")
    mark_flags(fig, PPO_EVENTS)
    bands = [p.get_x() for p in steps.patches]  # axvspan: a rectangle from its start
    assert bands == [4, 7] and not other.patches  # since -> step, for the two monitor events only


def test_running_run_with_half_written_line(tmp_path):
    run_dir = make_run(tmp_path, "ppo")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "ppo/score": 1.')
    with open(run_dir / "events.jsonl", "a") as f:
        f.write('{"step": 13, "event": "kl_')
    text = check_plots(Path(report.write_report(str(run_dir))), report.EXPECTED_PLOTS["ppo"])
    assert "13 (last step 12)" in text


def test_bare_run_without_eval_events_samples_or_config(tmp_path):
    run_dir = make_run(tmp_path, "ppo", extras=False, with_eval=False)
    text = check_plots(Path(report.write_report(str(run_dir))), report.EXPECTED_PLOTS["ppo"])
    assert "No events." in text and "No samples." in text and "No config.json." in text
    assert not (run_dir / "report" / "win_rate.png").exists() and "win_rate.png" not in text


def test_all_nan_plot_is_skipped(tmp_path):
    run_dir = tmp_path / "rm"
    run_dir.mkdir()
    records = _rm_metrics()
    for r in records:
        r["timing/tokens_per_s"] = math.nan
    _write_jsonl(run_dir / "metrics.jsonl", records)
    text = Path(report.write_report(str(run_dir))).read_text()
    assert "loss.png" in text and "throughput.png" not in text


def test_cli(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty'}: no metrics.jsonl" in capsys.readouterr().err
    run_dir = make_run(tmp_path, "rm", extras=False)
    assert report.main([str(run_dir), "--output", str(tmp_path / "x.html")]) == 0
    assert (tmp_path / "x.html").exists() and (tmp_path / "report" / "loss.png").exists()


def test_no_steps_yet(tmp_path):
    """A PPO run that has only written its step-0 eval: kind unknown, a page without plots."""
    run_dir = tmp_path / "early"
    run_dir.mkdir()
    _write_jsonl(run_dir / "metrics.jsonl", [{"step": 0} | _ppo_eval(0)])
    assert report.expected_plots(str(run_dir)) == []
    assert "No plottable metrics yet." in Path(report.write_report(str(run_dir))).read_text()
