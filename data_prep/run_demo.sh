#!/usr/bin/env bash
# The tiny end-to-end demo on CPU: synthetic preference data -> tiny model -> parquet splits
# -> reward model (train/train_rm.py under the deepspeed launcher) (-> PPO, with train/train_ppo.py).
# Usage: bash data_prep/run_demo.sh [OUT_DIR]   (what `make demo` runs)
set -euo pipefail
out="${1:-runs/demo}"
export DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false

echo "== 1/4 synthetic preference task"
python -m data_prep.synthetic_task --out "$out/raw/pairs.jsonl" --num-pairs 4000 --seed 0
echo "== 2/4 tiny model and tokenizer"
python -m data_prep.make_tiny_model --text "$out/raw/pairs.jsonl" --out "$out/tiny-base" --seed 0
echo "== 3/4 train/validation parquet splits"
python -m data_prep.prepare_preferences --input "$out/raw/pairs.jsonl" --tokenizer "$out/tiny-base" \
    --out "$out/data" --seed 0
echo "== 4/4 reward model (deepspeed launcher, ZeRO-3, 1 rank)"
deepspeed --num_gpus 1 train/train_rm.py --config ds_configs/demo_rm.json \
    --model.path "$out/tiny-base" --data.train "$out/data/train.parquet" \
    --data.validation "$out/data/validation.parquet" --logging.output_dir "$out/rm"
echo "demo done: reward model in $out/rm/model, metrics in $out/rm/metrics.jsonl (PPO arrives with train/train_ppo.py)"
