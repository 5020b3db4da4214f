"""Where a training step's time goes on the GPU (run by tests/gpu/check.sh).

    python tests/gpu/step_costs.py MODEL_DIR

One packed micro-batch (64 sequences of 128 tokens) forward + backward + optimizer step of a
causal LM in bf16: the bare model with our ``sdpa_varlen`` attention, the bare model with torch's
varlen flash kernel in its place, and the model inside a DeepSpeed ZeRO-2 and ZeRO-3 engine.
Also the cost of one tiny kernel launch plus synchronisation, which bounds how fast
per-sequence loops and ZeRO-3's per-module hooks can go on this machine.
"""

from __future__ import annotations

import json
import os
import sys
import time

import deepspeed
import torch
from transformers import AttentionInterface
from varlen_attention import torch_varlen  # tests/gpu, this script's directory

from engine.data import packing
from engine.data.packing import pack_sequences, packed_forward
from engine.models.deepspeed_glue import initialize_training_engine, training_ds_config
from engine.models.loading import load_causal_lm

SEQS, LEN, REPS = 64, 128, 5


def torch_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface over torch's varlen kernel (packed rows only)."""
    groups = getattr(module, "num_key_value_groups", 1)
    q, k, v = (
        x[0].transpose(0, 1).contiguous()
        for x in (query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1))
    )
    return torch_varlen(q, k, v, kwargs["cu_seq_lens_q"], scale=scaling)[None], None


def step_seconds(model, step) -> float:
    """Mean seconds of forward + backward + ``step()`` after two warm-ups."""
    torch.manual_seed(0)
    packed = pack_sequences([torch.randint(4, 500, (LEN,)).tolist() for _ in range(SEQS)])
    for i in range(REPS + 2):
        if i == 2:
            torch.cuda.synchronize()
            start = time.perf_counter()
        loss = packed_forward(model, packed)[0].float().logsumexp(-1).mean()
        (model.backward(loss) if hasattr(model, "backward") else loss.backward())
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPS


def main(model_dir: str) -> None:
    cuda = torch.device("cuda", 0)
    x = torch.ones(1, device=cuda)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(1000):
        x.add_(1)
    torch.cuda.synchronize()
    launch_us = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    for _ in range(200):
        x.add_(1).item()
    sync_us = (time.perf_counter() - start) * 1e6 / 200
    print(f"kernel launch {launch_us:.1f} us each (1,000 queued adds); launch + sync {sync_us:.1f} us")
    tokens = SEQS * LEN
    for name, attention in (("sdpa_varlen", packing.varlen_sdpa_attention), ("torch varlen", torch_varlen_attention)):
        AttentionInterface.register(packing.VARLEN_SDPA, attention)  # packed_forward passes cu_seq_lens to this name
        model = load_causal_lm(model_dir, dtype=torch.bfloat16).to(cuda)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-5)
        try:
            s = step_seconds(model, lambda optim=optim: (optim.step(), optim.zero_grad()))
            print(f"bare model, {name}: {s * 1e3:.1f} ms per step, {tokens / s:,.0f} tokens/s")
        except Exception as e:
            print(f"bare model, {name}: {type(e).__name__}: {e}")
    AttentionInterface.register(packing.VARLEN_SDPA, packing.varlen_sdpa_attention)  # ours for the engines
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29544")
    deepspeed.init_distributed("nccl")
    for cfg_name in ("zero2.json", "zero3.json"):
        with open(os.path.join("ds_configs", cfg_name)) as f:
            ds = training_ds_config(json.load(f), bf16=True)
        engine = initialize_training_engine(
            load_causal_lm(model_dir, dtype=torch.float32), ds, 1e-5, (0.9, 0.95), 0.0, "constant", 0, 100
        )
        s = step_seconds(engine, engine.step)
        print(
            f"DeepSpeed {cfg_name[:-5]}, sdpa_varlen: {s * 1e3:.1f} ms per step, {tokens / s:,.0f} tokens/s, "
            f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        )


if __name__ == "__main__":
    main(sys.argv[1])
