"""Training steps through real DeepSpeed engines, with and without shared prompts.

    deepspeed --num_gpus 2 tests/scripts/shared_prompt_steps.py MODEL_DIR PAIRS_PARQUET

For ZeRO-2 and ZeRO-3, from fresh engines per packing (same initial weights: same seed), one SGD
step (lr 1, no clipping: ``before - after`` is the averaged gradient) of
- the reward model: every rank scores its share of the global token-budget plan
  (engine/rm/reward_model.score_pairs, chosen and rejected sharing their prompt's tokens or not)
  and backpropagates the BT loss;
- PPO's actor and critic (engine/ppo/update.actor_step, critic_step) on this rank's samples,
  three per prompt, their prompt packed once or with every sample; the old log-probs come from
  an experience forward (engine/ppo/forwards.sequence_logprobs), computed both ways;
- under ZeRO-3 with shared prompts, the actor step under each ``ppo.loss_aggregation``
  against one process's gradient of the whole batch's aggregated loss;
- under ZeRO-3, DPO's step (engine/dpo/training.dpo_step: DPO with label smoothing with and without
  shared prompts, IPO and SimPO with them) against one process's gradient of the mean per-pair loss
  from a padded batch of whole sequences (tests/scripts/naive_pairs.py).
Rank 0 prints one JSON line: per model and stage the largest weight difference between the two
packings after the step and the largest update, the largest log-prob gap of the experience
forwards, the tokens each packing computed, and per aggregation the largest gap to the one-process
gradient and the largest gradient.
"""

from __future__ import annotations

import json
from dataclasses import replace

import torch
from naive_pairs import naive_losses, padded_response_logprobs
from sgd_engine import full_weights, launched_args, sgd_engine
from transformers import AutoTokenizer

from engine.data.batching import plan_global, token_mean_scale
from engine.data.packing import dummy_forward_loss
from engine.data.preferences import collate_pairs, load_preferences
from engine.dpo.training import PreferenceLossSettings, dpo_step
from engine.models.loading import load_causal_lm, load_value_model
from engine.ppo.experience import Experience
from engine.ppo.forwards import ValueReadout, pad_right, sequence_logprobs
from engine.ppo.losses import aggregation_weights
from engine.ppo.settings import PolicyLossSettings, UpdateSettings
from engine.ppo.update import actor_step, actor_token_loss, critic_step
from engine.rm.losses import pair_losses
from engine.rm.reward_model import score_pairs
from engine.run.distributed import all_reduce, shutdown_distributed
from engine.run.micro_batches import micro_batches

COMPONENTS = ["helpful", "harmless"]
WEIGHTS = torch.tensor([1.0, 1.0])
SETTINGS = PolicyLossSettings(
    clip_low=0.2, clip_high=0.2, clip_ratio_c=None, kl_loss_coef=0.1, kl_estimator="k3", entropy_coef=0.01
)
MAX_TOKENS = 60  # a few prompt groups per micro-batch, some split


def rm_step(model_dir: str, examples, stage: int, rank: int, world: int, max_tokens: int):
    """(weights before, weights after one SGD step), from fresh weights."""
    torch.manual_seed(0)  # the same new head
    engine, keep_alive = sgd_engine(lambda: load_value_model(model_dir, COMPONENTS), stage)
    before = full_weights(engine)
    for micro in plan_global([e.num_tokens for e in examples], max_tokens, world)[rank]:
        if not micro:
            engine.backward(dummy_forward_loss(engine, 0))
            continue
        batch = [examples[i] for i in micro]
        r_c, r_r = score_pairs(engine, batch)
        _, margins, labels = collate_pairs(batch)
        engine.backward(
            pair_losses(r_c, r_r, WEIGHTS, margins, labels).total.sum() * token_mean_scale(len(examples), world)
        )
    engine.step()
    after = full_weights(engine)
    del keep_alive
    return before, after


def rollout(vocab: int, rank: int) -> tuple[list[list[int]], list[int]]:
    """This rank's samples: 3 per prompt, contiguous; rank 1 gets one prompt fewer (uneven micro-batches)."""
    g = torch.Generator().manual_seed(10 + rank)
    sequences, prompt_lens = [], []
    for _ in range(5 - rank):
        p = int(torch.randint(2, 30, (1,), generator=g))
        prompt = torch.randint(4, vocab, (p,), generator=g).tolist()
        for _ in range(3):
            sequences.append(
                prompt + torch.randint(4, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            )
            prompt_lens.append(p)
    return sequences, prompt_lens


def experience(sequences, prompt_lens, old_logprobs: list[torch.Tensor], rank: int) -> Experience:
    g = torch.Generator().manual_seed(20 + rank)
    R = [len(s) - p for s, p in zip(sequences, prompt_lens)]
    T, B = max(R), len(R)
    mask = pad_right([torch.ones(r, dtype=torch.bool) for r in R], T)
    noise = lambda: torch.randn(B, T, generator=g) * mask
    old = pad_right(old_logprobs, T) + 0.05 * noise()  # near the policy: some ratios clip, most do not
    return Experience(
        sequences,
        prompt_lens,
        mask,
        old,
        old + 0.1 * noise(),
        noise(),
        noise(),
        noise(),
        torch.zeros(B),
        torch.zeros(B, T),
        mask.float(),
        noise(),
    )


def ppo_settings(samples: int, share: bool) -> UpdateSettings:
    return UpdateSettings(
        policy=SETTINGS,
        value_readout=ValueReadout(torch.ones(1)),
        value_clip=0.2,
        ppo_epochs=1,
        mini_batch_size=samples,  # the steps take the whole experience (update_on_rollout cuts it)
        max_tokens=MAX_TOKENS,
        pad_token_id=0,
        seed=0,
        share_prompts=share,
    )


def ppo_step(model_dir: str, stage: int, rank: int, share: bool, samples) -> dict:
    """Weights of the actor and the critic before and after one step, the largest gap between the
    old log-probs with and without sharing (the experience is built from the unshared ones), the
    tokens computed."""
    torch.manual_seed(0)
    actor, keep_actor = sgd_engine(lambda: load_causal_lm(model_dir), stage)
    critic, keep_critic = sgd_engine(lambda: load_value_model(model_dir, ["value"]), stage)
    sequences, prompt_lens = samples
    with torch.no_grad():  # as in make_experience
        old, old_shared = (sequence_logprobs(actor, sequences, prompt_lens, MAX_TOKENS, 0, s) for s in (False, True))
    gap = (torch.cat(old) - torch.cat(old_shared)).abs().max().reshape(1)
    exp = experience(sequences, prompt_lens, old, rank)
    before = {"actor": full_weights(actor), "critic": full_weights(critic)}
    settings = ppo_settings(len(sequences), share)
    actor_step(actor, exp, settings, iteration=0)
    critic_step(critic, exp, settings)
    after = {"actor": full_weights(actor), "critic": full_weights(critic)}
    tokens = torch.tensor(
        [float(sum(p.num_tokens for _, p in micro_batches(actor, sequences, prompt_lens, MAX_TOKENS, 0, share)))]
    )
    all_reduce(tokens)
    all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    del keep_actor, keep_critic
    return {"before": before, "after": after, "gap": gap.item(), "tokens": int(tokens.item())}


def gathered(exp: Experience) -> Experience:
    """Every rank's experience as one batch (rank order), padded to the longest response."""
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, exp)
    T = max(e.mask.shape[1] for e in parts)
    pad = lambda t: torch.nn.functional.pad(t, (0, T - t.shape[1])) if t.dim() == 2 else t
    fields = {  # the tensors (a distillation run's teacher: none here)
        f: torch.cat([pad(getattr(e, f)) for e in parts])
        for f in vars(exp)
        if f not in ("sequences", "prompt_lens", "teacher")
    }
    return Experience([s for e in parts for s in e.sequences], [p for e in parts for p in e.prompt_lens], **fields)


def aggregation_gap(model_dir: str, rank: int, samples, aggregation: str) -> dict[str, float]:
    """One ZeRO-3 actor step on every rank's own samples under ``aggregation``, against the
    gradient of the whole batch's aggregated loss in one process, from whole-sequence forwards
    of a plain model: the largest difference, and the largest gradient (rank 0's figures)."""
    torch.manual_seed(0)
    actor, keep_alive = sgd_engine(lambda: load_causal_lm(model_dir), 3)
    sequences, prompt_lens = samples
    with torch.no_grad():
        old = sequence_logprobs(actor, sequences, prompt_lens, MAX_TOKENS, 0, True)
    exp = experience(sequences, prompt_lens, old, rank)
    policy = replace(SETTINGS, aggregation=aggregation, norm_tokens=16)
    before = full_weights(actor)
    actor_step(actor, exp, replace(ppo_settings(len(sequences), True), policy=policy), iteration=0)
    after = full_weights(actor)
    del keep_alive
    whole = gathered(exp)
    if rank != 0:
        return {}
    model = load_causal_lm(model_dir)
    logprob_rows, entropy_rows = [], []
    for seq, p in zip(whole.sequences, whole.prompt_lens):
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, p - 1 : -1].float()  # (R, V)
        logp = logits.log_softmax(-1)
        logprob_rows.append(logp.gather(-1, torch.tensor(seq[p:])[:, None]).squeeze(-1))
        entropy_rows.append(-(logp.exp() * logp).sum(-1))
    T = whole.mask.shape[1]
    loss = actor_token_loss(pad_right(logprob_rows, T), pad_right(entropy_rows, T), whole, policy).per_token
    S, N = int(whole.mask.any(1).sum()), int(whole.mask.sum())
    (loss * aggregation_weights(whole.mask, aggregation, S, N, policy.norm_tokens)).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {
        "gap": max((before[n] - after[n] - grads[n]).abs().max().item() for n in grads),
        "grad": max(g.abs().max().item() for g in grads.values()),
    }


DPO_CASES = {  # name: (loss, shared prompts)
    "dpo_plain": (PreferenceLossSettings("dpo", 0.5, 0.1, 0.0), False),
    "dpo": (PreferenceLossSettings("dpo", 0.5, 0.1, 0.0), True),
    "ipo": (PreferenceLossSettings("ipo", 0.5, 0.0, 0.0), True),
    "simpo": (PreferenceLossSettings("simpo", 2.0, 0.0, 0.5), True),
}


def dpo_gap(model_dir: str, pairs, settings: PreferenceLossSettings, rank: int) -> dict[str, float]:
    """One ZeRO-3 DPO step on every rank's share of ``pairs`` (several micro-batches) against one
    process's gradient of the mean naive per-pair loss (rank 0's figures). The reference's log-probs
    are the initial policy's, moved by seeded noise so that the implicit rewards are not zero."""
    torch.manual_seed(0)
    model = load_causal_lm(model_dir)
    with torch.no_grad():
        start = torch.stack([r.sum() for r in padded_response_logprobs(model, pairs)]).view(-1, 2)
    reference = start + 0.5 * torch.randn(start.shape, generator=torch.Generator().manual_seed(0))
    engine, keep_alive = sgd_engine(lambda: load_causal_lm(model_dir), 3)
    before = full_weights(engine)
    metrics = dpo_step(engine, pairs, reference, settings, max_tokens=400, pad_token_id=0, step=1)
    after = full_weights(engine)
    del keep_alive
    if rank != 0:
        return {}
    rows = padded_response_logprobs(model, pairs)
    loss, chosen, rejected = naive_losses(
        rows, reference, settings.loss, settings.beta, settings.label_smoothing, settings.simpo_gamma
    )
    loss.mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    naive = {
        "loss": loss.mean().item(),
        "chosen_reward": chosen.mean().item(),
        "rejected_reward": rejected.mean().item(),
        "acc": (chosen > rejected).float().mean().item(),
        "chosen_logp": torch.stack([r.sum() for r in rows[0::2]]).mean().item(),
    }
    return {
        "gap": max((before[n] - after[n] - grads[n]).abs().max().item() for n in grads),
        "grad": max(g.abs().max().item() for g in grads.values()),
        "metric_gap": max(abs(metrics[k] - v) for k, v in naive.items()),
        "acc": metrics["acc"],
    }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def main() -> None:
    args, rank, world = launched_args("model", "pairs")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    plain, shared = (
        load_preferences(args.pairs, tokenizer, COMPONENTS, use_margin=False, share_prompt=s)[:24]
        for s in (False, True)
    )
    report = {
        "world": world,
        "tokens": {"plain": sum(e.num_tokens for e in plain), "shared": sum(e.num_tokens for e in shared)},
    }
    samples = rollout(tokenizer.vocab_size, rank)
    for stage in (2, 3):
        # A budget of a few pairs: several micro-batches per rank, planned from each packing's own token counts.
        (start, w_plain), (_, w_shared) = (
            rm_step(args.model, ex, stage, rank, world, max_tokens=400) for ex in (plain, shared)
        )
        report[f"zero{stage}"] = {"weight_diff": max_diff(w_plain, w_shared), "update": max_diff(w_plain, start)}
        whole, once = (ppo_step(args.model, stage, rank, share, samples) for share in (False, True))
        report[f"ppo_zero{stage}"] = {
            "logprob_gap": once["gap"],
            "tokens": {"plain": whole["tokens"], "shared": once["tokens"]},
            **{
                m: {
                    "weight_diff": max_diff(whole["after"][m], once["after"][m]),
                    "update": max_diff(whole["after"][m], whole["before"][m]),
                }
                for m in ("actor", "critic")
            },
        }
    report["aggregation"] = {
        a: aggregation_gap(args.model, rank, samples, a)
        for a in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    }
    report["dpo"] = {
        name: dpo_gap(args.model, shared if share else plain, settings, rank)
        for name, (settings, share) in DPO_CASES.items()
    }
    if rank == 0:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
    shutdown_distributed()
