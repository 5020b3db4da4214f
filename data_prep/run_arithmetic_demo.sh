#!/usr/bin/env bash
# The verifiable-reward demo on CPU: arithmetic word problems -> tiny model -> SFT on demonstrations
# (10% right, the others one too many) -> GRPO against the math verifier alone (no reward model, no critic), with
# held-out exact-match accuracy (HF generate, temperature 0) before and after.
# Usage: bash data_prep/run_arithmetic_demo.sh [OUT_DIR]   (it replaces an earlier demo in OUT_DIR)
set -euo pipefail
out="${1:-runs/arithmetic}"
export DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
exact_match() {  # MODEL_DIR NAME: held-out exact match, printed and kept in $out/exact_match_NAME.txt
    python -m engine.rewards.exact_match --model "$1" --prompts "$out/data/prompts_validation.parquet" | tee "$out/exact_match_$2.txt"
}

echo "== 1/5 arithmetic task, tiny model, parquet splits"
python -m data_prep.arithmetic_task --out "$out/raw" --demonstration-accuracy 0.1 --offsets=1
python -m data_prep.make_tiny_model --text "$out/raw/demonstrations.jsonl" --out "$out/tiny-base"
python -m data_prep.prepare_sft --input "$out/raw/demonstrations.jsonl" --tokenizer "$out/tiny-base" --out "$out/data"
python -m data_prep.prepare_prompts --input "$out/raw/prompts.jsonl" --fields answer --validation-fraction 0 \
    --tokenizer "$out/tiny-base" --out "$out/data"
python -m data_prep.prepare_prompts --input "$out/raw/eval_prompts.jsonl" --fields answer --validation-fraction 1 \
    --tokenizer "$out/tiny-base" --out "$out/data"
echo "== 2/5 supervised fine-tuning on the demonstrations"
deepspeed --num_gpus 1 train/train_sft.py --config ds_configs/arithmetic_sft.json \
    --model.path "$out/tiny-base" --data.train "$out/data/sft_train.parquet" \
    --data.validation "$out/data/sft_validation.parquet" --logging.output_dir "$out/sft" --overwrite
echo "== 3/5 held-out exact match of the SFT model"
exact_match "$out/sft/model" sft
echo "== 4/5 GRPO against the math verifier"
deepspeed --num_gpus 1 train/train_ppo.py --config ds_configs/arithmetic_grpo.json \
    --actor.path "$out/sft/model" --data.prompts "$out/data/prompts_train.parquet" \
    --data.eval_prompts "$out/data/prompts_validation.parquet" --logging.output_dir "$out/grpo" --overwrite
echo "== 5/5 held-out exact match of the GRPO policy"
exact_match "$out/grpo/actor" grpo
echo "arithmetic demo done: held-out exact match (HF generate, temperature 0) $(cut -d' ' -f3 "$out/exact_match_sft.txt") (SFT) -> $(cut -d' ' -f3 "$out/exact_match_grpo.txt") (GRPO); report in $out/grpo/report.html"
