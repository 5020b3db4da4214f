#!/usr/bin/env bash
# The tool-use demo on CPU: arithmetic word problems on numbers up to 999 (products of numbers up to 99), which
# the tiny model cannot compute, solved with and without the calculator tool by the same tiny model:
#   with:    SFT on demonstrations that call the calculator, then GRPO with multi-turn episodes
#            (rollout.environment: engine.environments.tools:ToolEnvironment) against the math verifier;
#   without: SFT on worked demonstrations of the same problems, then GRPO against the math verifier.
# Each GRPO run's held-out greedy exact match (its own evaluations, before and after) is printed at the end.
# Usage: bash data_prep/run_tool_demo.sh [OUT_DIR]   (it replaces an earlier demo in OUT_DIR)
set -euo pipefail
out="${1:-runs/tools}"
export DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
task=(--max-operand 999 --multiplication --max-factor 99 --demonstration-accuracy 1 --num-demonstrations 1500)
greedy() {  # RUN_LOG: the run's held-out greedy exact match, "a -> b"
    grep -o "math (greedy) [0-9.]* -> [0-9.]*" "$1" | cut -d' ' -f3-
}

echo "== 1/4 the task twice (the same problems; demonstrations with the tool and without), one tiny model for both"
python -m data_prep.arithmetic_task --out "$out/raw_tool" --tool-calls "${task[@]}"
python -m data_prep.arithmetic_task --out "$out/raw_plain" "${task[@]}"
python -m data_prep.make_tiny_model --text "$out/raw_tool/demonstrations.jsonl" --text "$out/raw_plain/demonstrations.jsonl" \
    --split-digits --out "$out/tiny-base"
for kind in tool plain; do
    python -m data_prep.prepare_sft --input "$out/raw_$kind/demonstrations.jsonl" --tokenizer "$out/tiny-base" \
        --out "$out/data_$kind"
done
python -m data_prep.prepare_prompts --input "$out/raw_tool/prompts.jsonl" --fields answer --validation-fraction 0 \
    --tokenizer "$out/tiny-base" --out "$out/data"
python -m data_prep.prepare_prompts --input "$out/raw_tool/eval_prompts.jsonl" --fields answer --validation-fraction 1 \
    --tokenizer "$out/tiny-base" --out "$out/data"
echo "== 2/4 supervised fine-tuning, with the tool and without"
for kind in tool plain; do
    deepspeed --num_gpus 1 train/train_sft.py --config ds_configs/arithmetic_sft.json --model.path "$out/tiny-base" \
        --data.train "$out/data_$kind/sft_train.parquet" --data.validation "$out/data_$kind/sft_validation.parquet" \
        --logging.output_dir "$out/sft_$kind" --overwrite
done
echo "== 3/4 GRPO with the calculator (multi-turn episodes)"
deepspeed --num_gpus 1 train/train_ppo.py --config ds_configs/tool_grpo.json --actor.path "$out/sft_tool/model" \
    --data.prompts "$out/data/prompts_train.parquet" --data.eval_prompts "$out/data/prompts_validation.parquet" \
    --logging.output_dir "$out/grpo_tool" --overwrite | tee "$out/grpo_tool.log"
echo "== 4/4 GRPO without it"
deepspeed --num_gpus 1 train/train_ppo.py --config ds_configs/arithmetic_grpo.json --actor.path "$out/sft_plain/model" \
    --data.prompts "$out/data/prompts_train.parquet" --data.eval_prompts "$out/data/prompts_validation.parquet" \
    --rollout.max_new_tokens 64 --logging.output_dir "$out/grpo_plain" --overwrite | tee "$out/grpo_plain.log"
echo "tool demo done: held-out greedy exact match with the calculator $(greedy "$out/grpo_tool.log"), without it" \
    "$(greedy "$out/grpo_plain.log") (SFT -> GRPO); reports in $out/grpo_tool/report.html and $out/grpo_plain/report.html"
