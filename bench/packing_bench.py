"""Packed + token-budget batches vs padded batches: padding fraction and real tokens/s.

    python bench/packing_bench.py [--pairs 256] [--budgets 1024,2048] [--padded-batch 8]

Workload: reward-model forward + backward (Bradley-Terry loss over chosen/rejected pairs) of the
tiny model (Llama h128, 4 layers, byte-BPE 4k trained on the data) on the real HH-RLHF harmless
pairs (../shared/data/hh-rlhf), truncated to 512 tokens like TRL's RewardTrainer default. The
padded baseline pads each batch of ``--padded-batch`` pairs to its longest sequence (what
TRL's collator does); the packed runs plan micro-batches of at most each ``--budget`` tokens.
Prints a table and the ratio of real tokens/s against the padded baseline (target >= 1.8x,
padding <= 5% of processed tokens).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from data_prep import make_tiny_model
from data_prep.prepare_preferences import Tally, read_pairs
from engine.data.batching import plan_micro_batches
from engine.data.chat import tokenize_pairs
from engine.data.packing import last_token, pack_sequences, packed_forward
from engine.models.loading import load_value_model

HH = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
MAX_LENGTH = 512


def load_pairs(model_dir: str, n_pairs: int) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) of the first ``n_pairs`` usable HH pairs, truncated to 512."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = [p for _, p in read_pairs([str(HH)], "train", skip_invalid=True, tally=Tally())][:n_pairs]
    prompts = [p.prompt for p in pairs] * 2
    _, full = tokenize_pairs(tokenizer, prompts, [p.chosen for p in pairs] + [p.rejected for p in pairs])
    full = [ids[-MAX_LENGTH:] for ids in full]  # keep the end: the reward is read at the last token
    return list(zip(full[: len(pairs)], full[len(pairs) :]))


def bt_loss(rewards: torch.Tensor) -> torch.Tensor:
    """rewards (pairs, 2) [chosen, rejected] -> summed -log sigmoid(r_c - r_r)."""
    return -F.logsigmoid(rewards[:, 0] - rewards[:, 1]).sum()


def run_padded(model, pairs, batch: int) -> tuple[int, int]:
    """One epoch of padded batches; returns (processed tokens, real tokens)."""
    processed = real = 0
    for start in range(0, len(pairs), batch):
        seqs = [s for pair in pairs[start : start + batch] for s in pair]  # c0, r0, c1, r1, ...
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        scores = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[..., 0]  # (2B, L)
        rewards = scores[torch.arange(len(seqs)), mask.sum(1) - 1].view(-1, 2)
        (bt_loss(rewards) / len(pairs)).backward()
        processed += ids.numel()
        real += int(mask.sum())
    return processed, real


def run_packed(model, pairs, budget: int) -> tuple[int, int]:
    processed = real = 0
    plan = plan_micro_batches([len(c) + len(r) for c, r in pairs], budget)
    for micro in plan:
        packed = pack_sequences([s for i in micro for s in pairs[i]])
        rewards = last_token(packed_forward(model, packed), packed)[:, 0].view(-1, 2)
        (bt_loss(rewards) / len(pairs)).backward()
        processed += packed.input_ids.numel()
        real += packed.num_tokens
    return processed, real


def timed(fn, repeats: int) -> tuple[float, int, int]:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        processed, real = fn()
    return (time.perf_counter() - start) / repeats, processed, real


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--budgets", default="1024,2048,4096")
    parser.add_argument("--padded-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not HH.is_file():
        print(f"needs the HH-RLHF file at {HH}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model.main(["--text", str(HH), "--out", tmp, "--vocab-size", "4096", "--num-layers", "4"])
        pairs = load_pairs(tmp, args.pairs)
        model = load_value_model(tmp)  # sdpa_varlen: plain sdpa for the padded batches
    rows = [
        (
            "padded",
            f"batch {args.padded_batch} pairs",
            timed(lambda: run_padded(model, pairs, args.padded_batch), args.repeats),
        )
    ]
    for budget in map(int, args.budgets.split(",")):
        timing = timed(lambda budget=budget: run_packed(model, pairs, budget), args.repeats)
        rows.append(("packed", f"<= {budget} tokens", timing))

    base_tps = rows[0][2][2] / rows[0][2][0]
    print(
        f"{len(pairs)} HH pairs, tiny Llama h128 L4, forward+backward of the BT loss, {torch.get_num_threads()} threads"
    )
    print(
        f"{'mode':<8}{'batching':<20}{'processed':>10}{'real':>9}{'padding':>9}{'s/epoch':>9}"
        f"{'real tok/s':>12}{'vs padded':>11}"
    )
    for mode, desc, (seconds, processed, real) in rows:
        tps = real / seconds
        print(
            f"{mode:<8}{desc:<20}{processed:>10}{real:>9}{1 - real / processed:>9.1%}{seconds:>9.2f}"
            f"{tps:>12.0f}{tps / base_tps:>10.2f}x"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
