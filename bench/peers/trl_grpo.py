"""TRL's GRPOTrainer on the arithmetic task's SFT model, with the same math check as ours
(engine.rewards.verifiers.math_reward, called in-process as TRL calls reward functions); run in
the peer venv by bench/grpo_vs_trl.py and, with ``--tool-calls N`` (our calculator as TRL's tool, up
to N calls per episode), by bench/tool_grpo_vs_trl.py. Prints one JSON line with the seconds of each
iteration (one generation of prompts x samples and one optimizer step over it) and the policy's
turns per episode in each."""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from iteration_clock import IterationClock, train_and_print_step_seconds
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_template

from engine.environments.tools import calculator
from engine.rewards.verifiers import math_reward

# The tiny model's chat template (data_prep/make_tiny_model.py) with an assistant turn's tool calls
# written as the tool demonstrations write them, <tool_call>{"name": ..., "arguments": {...}}</tool_call>
# (TRL renders them to find the tool result's ids). No tools section: prompts render as without tools.
TOOL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>{\"name\": ' + call['function']['name'] | tojson + ', \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson + '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
turns: list[float] = []  # the policy's turns per episode, mean of each generation


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's final answer equals the row's ``answer`` (its messages' text, as our
    trainer decodes an episode whole)."""
    turns.append(sum(m["role"] == "assistant" for c in completions for m in c) / len(completions))
    return [math_reward("\n".join(m["content"] for m in c), a) for c, a in zip(completions, answer)]


def tool_tokenizer(path: str, prompts: list[list[dict]]):
    """The model's tokenizer with :data:`TOOL_CHAT_TEMPLATE` and Qwen3's response parser (its
    ``<tool_call>{json}</tool_call>`` turns, ChatML's assistant header and end); each prompt renders as
    with the model's own template."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    own = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tokenizer.chat_template, tokenizer.response_template = TOOL_CHAT_TEMPLATE, qwen3_template
    with_tools = [
        tokenizer.apply_chat_template(p, tools=[calculator], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    assert own == with_tools, "the tool template renders a prompt otherwise than the model's"
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--actor", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--prompts-per-iteration", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kl-coef", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--micro-batch", type=int, default=32, help="rows per forward/backward")
    parser.add_argument("--use-vllm", action="store_true", help="TRL's colocated vLLM generation")
    parser.add_argument("--tool-calls", type=int, default=0, help="calculator calls per episode at most (0: no tool)")
    args = parser.parse_args()
    torch.manual_seed(0)
    table = pq.read_table(args.prompts).slice(0, args.iterations * args.prompts_per_iteration)
    prompts = table.column("prompt").to_pylist()
    dataset = Dataset.from_dict({"prompt": prompts, "answer": table.column("answer").to_pylist()})
    rows = args.prompts_per_iteration * args.samples_per_prompt
    if rows % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide the {rows} rows of an iteration")
    config = GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch,  # one optimizer step per generation
        num_generations=args.samples_per_prompt,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        beta=args.kl_coef,
        num_iterations=1,
        shuffle_dataset=False,
        use_vllm=args.use_vllm,
        vllm_mode="colocate",
        report_to="none",
        save_strategy="no",
        logging_steps=1000,
        use_cpu=True,
        seed=0,
        max_tool_calling_iterations=args.tool_calls or None,
    )
    clock = IterationClock()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.actor),
        reward_funcs=correct,
        args=config,
        train_dataset=dataset,
        processing_class=tool_tokenizer(args.actor, prompts)
        if args.tool_calls
        else AutoTokenizer.from_pretrained(args.actor),
        callbacks=[clock],
        tools=[calculator] if args.tool_calls else None,
    )
    train_and_print_step_seconds(trainer, clock, turns=turns)


if __name__ == "__main__":
    main()
