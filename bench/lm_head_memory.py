"""Peak memory of response log-probs and entropy at a real vocabulary: the chunked LM head
(engine/data/lm_head.py) against the whole-matrix computation it replaced.

    python bench/lm_head_memory.py [--tokens 1024 2048 4096 8192] [--before-max 4096]

A Qwen2.5-0.5B-shaped model with one decoder layer (hidden 896, tied embeddings, V = 151,936,
random weights, fp32, CPU) runs on one packed row of 64 sequences; K response tokens (the row's
last K positions) get their log-prob and entropy, as PPO's experience forward does (no gradient)
and as its actor step does (forward + backward of a loss on both). Each measurement is its own
process: the peak resident memory during the computation minus the resident memory before it, and
its wall time.
"Before" is the code this replaced: the head on all K positions at once, then ``logsumexp`` for the
log-probs and a full log-softmax for the entropy; it runs up to ``--before-max`` tokens (at 8,192
its training step needs more than this machine's 24 GiB) and is linear in K beyond.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB, HIDDEN = 151_936, 896


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(path: str, phase: str, tokens: int) -> dict:
    """In this process: peak resident bytes above the level before the computation."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(REPO))
    from engine.data.lm_head import token_logprobs
    from engine.data.packing import pack_sequences, packed_forward, target_logprobs

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4864,
        num_hidden_layers=1,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attn_implementation="sdpa_varlen",
    )
    model = Qwen2ForCausalLM(config)
    per_sequence = tokens // 64 + 16
    packed = pack_sequences([[(i * 7 + t) % VOCAB for t in range(per_sequence)] for i in range(64)], 0)
    total = packed.input_ids.shape[1]
    positions = torch.arange(total - tokens - 1, total - 1)
    targets = packed.input_ids[0, positions + 1]

    def before():
        logits = packed_forward(model, packed, logits_positions=positions)[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return target_logprobs(logits, targets), -(logp.exp() * logp).sum(-1)

    compute = before if path == "before" else lambda: token_logprobs(model, packed, positions, targets, True, True)
    base, start = rss_bytes(), time.perf_counter()
    if phase == "experience":
        with torch.no_grad():
            compute()
    else:
        logp, entropy = compute()
        (logp.sum() + 0.01 * entropy.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"peak_gib": peak / 2**30, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--before-max", type=int, default=4096)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # path phase tokens: a child process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], int(args.one[2]))))
        return 0
    print(f"V = {VOCAB:,}, hidden {HIDDEN}, fp32; peak GiB above the level before the computation")
    print(f"{'K':>6} {'phase':>10} {'before':>8} {'chunked':>8} {'ratio':>6}   seconds before / chunked")
    for tokens in args.tokens:
        for phase in ("experience", "train"):
            peaks = {}
            for path in ("before", "chunked"):
                if path == "before" and tokens > args.before_max:
                    continue
                child = [sys.executable, __file__, "--one", path, phase, str(tokens)]
                peaks[path] = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
            nan = {"peak_gib": float("nan"), "seconds": float("nan")}
            before, chunked = peaks.get("before", nan), peaks["chunked"]
            print(
                f"{tokens:>6} {phase:>10} {before['peak_gib']:>8.2f} {chunked['peak_gib']:>8.2f} "
                f"{chunked['peak_gib'] / before['peak_gib']:>6.2f}   "
                f"{before['seconds']:.2f} / {chunked['seconds']:.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
