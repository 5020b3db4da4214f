"""What train/evaluate.py writes: ``summary.json`` (per model: pass@k, mean reward and components,
mean reward-model score; the win rate of the model over the baseline) and ``samples.jsonl`` (one line
per response: its prompt, text, scores and whether it is correct)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from engine.evaluate.pass_at_k import mean_pass_at_k, reported_ks
from engine.evaluate.policy import PolicyResponses
from engine.ppo.evaluation import win_scores
from engine.run.launch import RunRefused

SUMMARY, SAMPLES = "summary.json", "samples.jsonl"


def check_out_dir(out: str, overwrite: bool) -> None:
    """:class:`RunRefused` when ``out`` already holds an evaluation and ``overwrite`` is off (nothing changed)."""
    found = [name for name in (SUMMARY, SAMPLES) if os.path.exists(os.path.join(out, name))]
    if found and not overwrite:
        raise RunRefused(
            "output",
            f"--out {out} already holds {', '.join(found)}: pass --overwrite to replace them, or another --out",
        )


def mean(values: torch.Tensor) -> float:
    return values.double().mean().item()


def policy_summary(policy: PolicyResponses) -> dict[str, Any]:
    """A model's figures over its responses."""
    samples = policy.responses.samples
    summary: dict[str, Any] = {
        "model": policy.path,
        "responses": len(samples),
        "response_tokens": sum(s.sampled_length for s in samples) / len(samples),
        "finished": sum(s.finished for s in samples) / len(samples),  # ended with EOS, not at the length limit
    }
    if policy.correct is not None:
        per_prompt = policy.correct.view(-1, policy.n).tolist()  # (P, n)
        summary |= {f"pass@{k}": mean_pass_at_k(per_prompt, k) for k in reported_ks(policy.n)}
    if policy.rewards is not None:
        summary["reward"] = mean(policy.rewards)
        summary["components"] = {name: mean(values) for name, values in policy.components.items()}
    if policy.rm_scores is not None:
        summary["rm_score"] = mean(policy.rm_scores)
        summary["rm_heads"] = {name: mean(values) for name, values in policy.rm_heads.items()}
    return summary


def win_rate(policy: PolicyResponses, baseline: PolicyResponses) -> dict[str, float]:
    """The share of responses scoring above the baseline's to the same prompt and draw, ties half
    (PPO's ``eval/win_rate``), and its standard error."""
    assert policy.rm_scores is not None and baseline.rm_scores is not None
    wins = win_scores(policy.rm_scores, baseline.rm_scores)
    return {"win_rate": mean(wins), "win_rate_stderr": (wins.double().std() / len(wins) ** 0.5).item()}


def sample_rows(name: str, policy: PolicyResponses) -> Iterator[dict[str, Any]]:
    """``samples.jsonl``'s lines of one model (``name``: ``model`` or ``baseline``)."""
    r = policy.responses
    for i, (messages, sample, text) in enumerate(zip(r.prompts, r.samples, r.texts)):
        row: dict[str, Any] = {
            "policy": name,
            "prompt_index": i // policy.n,
            "sample": i % policy.n,
            "prompt": messages,
            "response": text,
            "response_tokens": sample.sampled_length,
            "finished": sample.finished,
        }
        if policy.rewards is not None:
            row["reward"] = policy.rewards[i].item()
            row["components"] = {name: values[i].item() for name, values in policy.components.items()}
        if policy.correct is not None:
            row["correct"] = bool(policy.correct[i])
        if policy.rm_scores is not None:
            row["rm_score"] = policy.rm_scores[i].item()
            row["rm_heads"] = {head: values[i].item() for head, values in policy.rm_heads.items()}
        yield row


def write_report(out: str, summary: dict[str, Any], policies: dict[str, PolicyResponses]) -> None:
    """``summary.json`` and ``samples.jsonl`` in ``out``, each written whole and renamed into place."""
    os.makedirs(out, exist_ok=True)
    lines = [json.dumps(row) + "\n" for name, policy in policies.items() for row in sample_rows(name, policy)]
    for name, text in ((SAMPLES, "".join(lines)), (SUMMARY, json.dumps(summary, indent=2) + "\n")):
        path = os.path.join(out, name)
        with open(f"{path}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{path}.tmp", path)
