"""Colocated vLLM + ZeRO-3 actor: greedy outputs agree before training, diverge after an update,
agree again after the bucketed weight sync; then samples at temperature 0.6 carry the actor's log-probs.

    deepspeed --num_gpus N tests/scripts/weight_sync_check.py MODEL_DIR [--tensor-parallel K] [--lora-rank R]

With ``--lora-rank`` only LoRA adapters train and are synced merged; the base weights synced with
the adapters disabled (the reference) must give the untrained greedy output again.

Prints one JSON line per rank (prefixed by nothing else on that line).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import AutoTokenizer

from engine.config import DS_CONFIGS_DIR
from engine.data.packing import next_token_logprobs, pack_sequences, packed_forward
from engine.models.deepspeed_glue import initialize_training_engine, load_partitioned, training_ds_config
from engine.models.loading import load_causal_lm
from engine.models.lora import adapters_disabled, add_adapters
from engine.ppo.forwards import sequence_logprobs
from engine.rollout.sampler import HFSampler, SamplingSettings
from engine.rollout.vllm_sampler import VLLMSampler
from engine.run.distributed import init_distributed, shutdown_distributed
from engine.run_config import LoraSection

GREEDY = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_new_tokens=12)
TEMPERATURE = 0.6
QUESTIONS = ["Tell me about the garden in Alder.", "What do you think of the river in Cobton?", "Hello"]


def tokens(samples) -> list[list[int]]:
    return [s[0].response_ids for s in samples]


def shard_rows(sampler: VLLMSampler) -> int:
    """Output rows of this rank's first fused qkv projection: the whole layer's, or a TP shard."""
    rows = sampler.llm.collective_rpc(
        lambda worker: next(
            m.output_size_per_partition for n, m in worker.model_runner.model.named_modules() if n.endswith("qkv_proj")
        )
    )
    return rows[0]


def tempered_gaps(engine, vllm: VLLMSampler, hf: HFSampler, prompts, pad_token_id: int) -> dict[str, float]:
    """At temperature 0.6 (3 samples a prompt): the largest |gap| between the actor's packed, shared-prompt
    log-probs and vLLM's (processed) ones, HF generate's, and log_softmax(logits / T) of a plain forward."""
    settings = SamplingSettings(n=3, temperature=TEMPERATURE, max_new_tokens=12)
    gaps = {}
    for name, sampler in (("vllm", vllm), ("hf", hf)):
        samples = [s for group in sampler.generate(prompts, settings, 7) for s in group]
        sequences, lens = [s.prompt_ids + s.response_ids for s in samples], [len(s.prompt_ids) for s in samples]
        with torch.no_grad():
            actor = sequence_logprobs(engine, sequences, lens, 4096, pad_token_id, True, TEMPERATURE)
            plain = [
                (engine(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float() / TEMPERATURE)
                .log_softmax(-1)[n - 1 : -1]
                .gather(-1, torch.tensor(seq[n:])[:, None])
                .squeeze(-1)
                for seq, n in zip(sequences, lens)
            ]
        gaps[f"tempered_gap_{name}"] = max(
            (a - torch.tensor(s.logprobs)).abs().max().item() for a, s in zip(actor, samples)
        )
        gaps[f"tempered_gap_plain_{name}"] = max((a - p).abs().max().item() for a, p in zip(actor, plain))
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=0)
    args = parser.parse_args()
    rank, world = init_distributed(timeout_s=300)
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in QUESTIONS
    ]
    with open(os.path.join(DS_CONFIGS_DIR, "tiny_cpu_zero3.json")) as f:
        ds_config = training_ds_config(json.load(f), bf16=False)
    actor, keep_alive = load_partitioned(lambda: load_causal_lm(args.model), ds_config)
    if args.lora_rank:
        actor = add_adapters(actor, LoraSection(rank=args.lora_rank), causal_lm=True)
    engine = initialize_training_engine(
        actor,
        ds_config,
        lr=3e-2,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        lr_scheduler="constant_with_warmup",
        warmup_steps=0,
        total_steps=10,
    )
    torch.manual_seed(123)
    vllm = VLLMSampler(
        args.model,
        seed=1000 + rank // args.tensor_parallel,
        dtype="float32",
        max_model_len=256,
        kv_cache_bytes=64 << 20,
        eos_token_id=tok.eos_token_id,
        tensor_parallel_size=args.tensor_parallel,
    )
    after_vllm = torch.rand(1)  # the trainer's stream, as if vLLM had never started
    torch.manual_seed(123)
    rng_preserved = torch.equal(after_vllm, torch.rand(1))
    hf = HFSampler(engine, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    v0, h0 = tokens(vllm.generate(prompts, GREEDY, 0)), tokens(hf.generate(prompts, GREEDY, 0))
    target = pack_sequences([prompts[0] + [tok.convert_tokens_to_ids("Calm")] * 8])  # teach the actor something else
    for _ in range(3):
        engine.backward(-torch.cat(next_token_logprobs(packed_forward(engine, target), target)).mean())
        engine.step()
    v_stale, h1 = tokens(vllm.generate(prompts, GREEDY, 0)), tokens(hf.generate(prompts, GREEDY, 0))
    start = time.perf_counter()
    vllm.sync_weights(engine)
    sync_s = time.perf_counter() - start
    v1 = tokens(vllm.generate(prompts, GREEDY, 0))
    tempered = tempered_gaps(engine, vllm, hf, prompts, tok.pad_token_id)
    with adapters_disabled(engine.module):  # LoRA: the base weights, i.e. the reference; else the same weights again
        vllm.sync_weights(engine)
    reference = tokens(vllm.generate(prompts, GREEDY, 0))
    start = time.perf_counter()
    vllm.generate(prompts, GREEDY, 0)
    generate_s = time.perf_counter() - start
    print(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "before_equal": v0 == h0,
                "actor_changed": h1 != h0,
                "stale_equal": v_stale == h1,
                "after_equal": v1 == h1,
                "rng_preserved": rng_preserved,
                "reference_is_start": reference == h0,
                "reference_is_actor": reference == h1,
                "sync_s": sync_s,
                "generate_s": generate_s,
                "shard_rows": shard_rows(vllm),
            }
            | tempered
        ),
        flush=True,
    )
    vllm.close()
    del keep_alive


if __name__ == "__main__":
    main()
    shutdown_distributed()
