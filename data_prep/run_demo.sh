#!/usr/bin/env bash
# The tiny end-to-end demo on CPU: synthetic preference data -> tiny model -> parquet splits
# (-> reward model -> PPO, added with train/train_rm.py and train/train_ppo.py).
# Usage: bash data_prep/run_demo.sh [OUT_DIR]   (what `make demo` runs)
set -euo pipefail
out="${1:-runs/demo}"
export DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false

echo "== 1/3 synthetic preference task"
python -m data_prep.synthetic_task --out "$out/raw/pairs.jsonl" --num-pairs 4000 --seed 0
echo "== 2/3 tiny model and tokenizer"
python -m data_prep.make_tiny_model --text "$out/raw/pairs.jsonl" --out "$out/tiny-base" --seed 0
echo "== 3/3 train/validation parquet splits"
python -m data_prep.prepare_preferences --input "$out/raw/pairs.jsonl" --tokenizer "$out/tiny-base" \
    --out "$out/data" --seed 0
echo "demo data ready in $out (reward model and PPO steps arrive with their scripts)"
