#!/usr/bin/env bash
# The GPU path in one short run on a lent device (see tests/gpu/wheels.sh for the wheels):
#   device run, carry [".whl"]:  bash tests/gpu/check.sh
# 1. tests/gpu/device_checks.py: packed log-probs/values on cuda equal the CPU ones and their
#    gradients reach the GPU weights, NCCL reduces CPU tensors, HF generate on cuda, RNG state.
# 2. train_rm.py (bf16, ZeRO-3) and train_ppo.py (bf16, ZeRO-3, HF sampler) under the deepspeed
#    launcher, then a PPO resume from the iteration-3 checkpoint compared with the straight run,
#    and 3 iterations sampled at T = 0.7 (the sampler/trainer log-prob gap, in temperature.log).
# 3. Figures: torch's varlen attention against our packed path (tests/gpu/varlen_attention.py) and
#    where a training step's time goes for a ~104M-parameter random Llama (tests/gpu/step_costs.py).
#    The PPO metrics carry peak GPU memory and the bf16 sampler/trainer log-prob gap.
# `bash tests/gpu/check.sh figures` runs step 3 alone.
# Logs and metrics land in $OUT (8 files), which the device tool brings back. Every step runs even
# after a failure (one device run should say as much as it can); the exit status is 1 when a
# device check failed or the resumed run's values differ from the straight run's.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
launcher=(python3 /tmp/site/bin/deepspeed --num_gpus 1)
w=/tmp/gpu_check; out=${OUT:-$w/out}; rm -rf "$w"; mkdir -p "$w" "$out"  # a warm machine keeps the last try's runs
nvidia-smi -L; python3 -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"

python3 -m data_prep.synthetic_task --out $w/pairs.jsonl --num-pairs 2000 --seed 0
python3 -m data_prep.make_tiny_model --text $w/pairs.jsonl --out $w/tiny --seed 0
python3 -m data_prep.prepare_preferences --input $w/pairs.jsonl --tokenizer $w/tiny --out $w/data --seed 0
status=0
if [ "${1:-all}" != figures ]; then
python3 tests/gpu/device_checks.py $w/tiny 2>&1 | tee $out/device_checks.log || { echo "device checks: FAILURES (above)"; status=1; }

common=(--deepspeed zero3.json --logging.wandb false --logging.tensorboard false --logging.progress_bar false)
"${launcher[@]}" train/train_rm.py --config ds_configs/demo_rm.json --model.path $w/tiny --model.bf16 true \
    --data.train $w/data/train.parquet --data.validation $w/data/validation.parquet --logging.output_dir $w/rm "${common[@]}" \
    2>&1 | tee $out/rm.log | tail -5
ppo=(train/train_ppo.py --config ds_configs/demo_ppo.json --actor.path $w/tiny --actor.bf16 true --reward_model.path $w/rm/model
     --data.prompts $w/data/prompts_train.parquet --data.eval_prompts $w/data/prompts_validation.parquet
     --rollout.sampler hf --train.iterations 6 --train.eval_every 3 --checkpoint.every_steps 3 "${common[@]}")
"${launcher[@]}" "${ppo[@]}" --logging.output_dir $w/ppo 2>&1 | tee $out/ppo.log | tail -5
cp -r $w/ppo $w/ppo_resumed  # holds checkpoints/step00000003; the resume rewinds the logs to it
"${launcher[@]}" "${ppo[@]}" --logging.output_dir $w/ppo_resumed --resume 2>&1 | tee -a $out/ppo.log | tail -5
# Sampling at T = 0.7: the trainer's tempered log-probs against the sampler's (ppo/sampler_logprob_gap).
"${launcher[@]}" "${ppo[@]}" --logging.output_dir $w/ppo_t07 --rollout.temperature 0.7 --train.iterations 3 \
    2>&1 | tee -a $out/ppo.log | tail -3 || status=1
python3 -c "import json,sys; [print('T=0.7', r['step'], 'sampler_logprob_gap', r.get('ppo/sampler_logprob_gap'), 'kl', r['ppo/kl']) for r in map(json.loads, open(sys.argv[1])) if 'ppo/kl' in r]" \
    $w/ppo_t07/metrics.jsonl 2>&1 | tee $out/temperature.log || status=1
cp $w/rm/metrics.jsonl $out/rm_metrics.jsonl; cp $w/ppo/metrics.jsonl $out/ppo_metrics.jsonl
python3 - $w/ppo/metrics.jsonl $w/ppo_resumed/metrics.jsonl <<'PY' 2>&1 | tee $out/resume.log || status=1
import json, sys
straight, resumed = ({r["step"]: r for r in map(json.loads, open(p)) if "ppo/score" in r} for p in sys.argv[1:])
keys = ("ppo/score", "ppo/kl", "ppo/pg_loss", "ppo/vf_loss")
differ = [s for s in straight if s > 3 and any(straight[s][k] != resumed.get(s, {}).get(k) for k in keys)]
for s, a in straight.items():
    b = resumed.get(s, {})
    print(s, " ".join(f"{k}={a[k]:.5f}/{b.get(k, float('nan')):.5f}" for k in keys), f"s/it={a['timing/iteration_s']:.3f}")
print("resume: exact" if not differ and sorted(resumed) == sorted(straight) else f"resume: DIFFERS at iterations {differ}")
sys.exit(1 if differ or sorted(resumed) != sorted(straight) else 0)
PY
fi

# 3. Figures (everything in figures.log).
python3 tests/gpu/varlen_attention.py > $w/varlen.log 2>&1 || status=1
python3 -m data_prep.make_tiny_model --text $w/pairs.jsonl --out $w/llama110m --seed 0 \
    --hidden-size 768 --num-layers 12 --num-heads 12 --num-kv-heads 4 --intermediate-size 3072 > /dev/null
{ cat $w/varlen.log; python3 tests/gpu/step_costs.py $w/llama110m; } 2>&1 | tee $out/figures.log || status=1
exit $status
