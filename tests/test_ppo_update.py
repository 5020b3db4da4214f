"""engine/ppo/update.py: the actor and critic losses are token-means over the whole mini-batch,
whatever its cut into micro-batches and ranks."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from engine.config import DS_CONFIGS_DIR
from engine.data.batching import token_mean_scale
from engine.data.response_tokens import kl_penalty
from engine.ppo.experience import Experience
from engine.ppo.forwards import ValueReadout, pad_right, sequence_values
from engine.ppo.losses import aggregation_weights, estimate_advantages
from engine.ppo.settings import GaeSettings, PolicyLossSettings, UpdateSettings
from engine.ppo.update import actor_step, actor_token_loss, critic_step, update_on_rollout

SETTINGS = PolicyLossSettings(
    clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, kl_loss_coef=0.1, kl_estimator="k3", entropy_coef=0.01
)
RESPONSE_LENS = [5, 1, 9, 3, 7, 2, 6, 4]


def update_settings(max_tokens: int = 24, **changes) -> UpdateSettings:
    """SETTINGS' policy loss, value clip 0.2, one epoch over the eight sequences as one mini-batch."""
    settings = UpdateSettings(
        policy=SETTINGS,
        value_readout=ValueReadout(torch.ones(1)),
        value_clip=0.2,
        ppo_epochs=1,
        mini_batch_size=len(RESPONSE_LENS),
        max_tokens=max_tokens,
        pad_token_id=0,
        seed=0,
    )
    return replace(settings, **changes)


def random_experience(vocab: int, seed: int = 0) -> Experience:
    """Eight sequences (prompt 3-5 tokens, responses of RESPONSE_LENS) with random rollout values."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab, (3 + i % 3,), generator=g).tolist() for i in range(len(RESPONSE_LENS))]
    responses = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    B, T = len(RESPONSE_LENS), max(RESPONSE_LENS)
    mask = pad_right([torch.ones(n, dtype=torch.bool) for n in RESPONSE_LENS], T)
    rand = lambda scale=1.0: torch.randn(B, T, generator=g) * scale * mask
    return Experience(
        sequences=[p + r for p, r in zip(prompts, responses)],
        prompt_lens=[len(p) for p in prompts],
        mask=mask,
        old_logprobs=rand(0.5) - 3.0 * mask,
        ref_logprobs=rand(0.5) - 3.0 * mask,
        old_values=rand(),
        advantages=rand(),
        returns=rand(),
        scores=torch.randn(B, generator=g),
        kl=rand(0.1),
        is_weights=mask.float(),
        rewards=rand(),
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_actor_loss_aggregates_the_mini_batch_whatever_the_split(aggregation):
    """OpenRLHF-style fake ranks: each rank weighs its micro-batches' per-token losses by
    aggregation_weights(global sequences and tokens) times the world size, and DeepSpeed averages
    the ranks' gradients; the result is the gradient of the full mini-batch's aggregated loss (the
    policy surrogate, the KL loss and the entropy bonus alike), for any cut into ranks and micro-batches."""
    exp = random_experience(vocab=50)
    g = torch.Generator().manual_seed(1)
    new_logprobs = (exp.old_logprobs + 0.3 * torch.randn(exp.mask.shape, generator=g) * exp.mask).requires_grad_()
    entropy = (torch.rand(exp.mask.shape, generator=g) * exp.mask).requires_grad_()
    S, N = exp.mask.shape[0], int(exp.mask.sum())
    weights = lambda mask: aggregation_weights(mask, aggregation, sequences=S, tokens=N, norm_tokens=12)

    per_token = actor_token_loss(new_logprobs, entropy, exp, SETTINGS).per_token
    (per_token * weights(exp.mask)).sum().backward()
    want = new_logprobs.grad.clone(), entropy.grad.clone()

    # 3 ranks with uneven shares, cut into micro-batches of 1-3 sequences.
    ranks = [[[0, 1], [2]], [[3], [4, 5, 6]], [[7]]]
    grads = torch.zeros_like(new_logprobs), torch.zeros_like(entropy)
    for rank in ranks:
        new_logprobs.grad, entropy.grad = None, None
        for micro in rank:
            mb, rows = exp.select(micro), torch.tensor(micro)
            per_token = actor_token_loss(new_logprobs[rows], entropy[rows], mb, SETTINGS).per_token
            ((per_token * weights(mb.mask)).sum() * len(ranks)).backward()
        grads[0].add_(new_logprobs.grad / len(ranks))  # DeepSpeed's gradient all-reduce averages over ranks
        grads[1].add_(entropy.grad / len(ranks))
    torch.testing.assert_close(grads[0], want[0], atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(grads[1], want[1], atol=1e-7, rtol=1e-6)
    entropy_grad = -SETTINGS.entropy_coef * weights(exp.mask)[exp.mask]
    assert want[1][exp.mask].allclose(entropy_grad)  # the entropy bonus is in the loss, aggregated alike
    if aggregation == "token_mean":  # the token mean of the critic's loss, too (engine/data/batching.py)
        assert weights(exp.mask)[exp.mask].allclose(torch.tensor(token_mean_scale(N, 1)))


def test_each_setting_changes_its_term_of_the_actor_loss():
    exp = random_experience(vocab=50)
    logprobs, entropy = exp.old_logprobs + 2.0 * exp.mask, torch.rand(exp.mask.shape) * exp.mask  # ratio e^2 ~ 7.4 > 3
    plain = PolicyLossSettings(
        clip_low=0.2, clip_high=0.28, clip_ratio_c=None, kl_loss_coef=0.0, kl_estimator="k3", entropy_coef=0.0
    )
    base = actor_token_loss(logprobs, entropy, exp, plain)
    assert base.kl is None and base.pg.capped is None
    negative = (exp.advantages < 0) & exp.mask
    dual = actor_token_loss(logprobs, entropy, exp, replace(plain, clip_ratio_c=3.0))
    assert torch.equal(dual.pg.capped, exp.advantages < 0)  # every negative-advantage token is past the cap
    assert (dual.per_token[negative] < base.per_token[negative]).all()
    assert torch.equal(dual.per_token[exp.mask & ~negative], base.per_token[exp.mask & ~negative])
    kl = actor_token_loss(logprobs, entropy, exp, replace(plain, kl_loss_coef=0.1))
    torch.testing.assert_close(kl.kl, kl_penalty(logprobs, exp.ref_logprobs, "k3"))
    torch.testing.assert_close(kl.per_token, base.per_token + 0.1 * kl.kl)
    bonus = actor_token_loss(logprobs, entropy, exp, replace(plain, entropy_coef=0.01))
    torch.testing.assert_close(bonus.per_token, base.per_token - 0.01 * entropy)
    weights = torch.rand(exp.mask.shape) * 2.0 * exp.mask  # importance weights (ppo.rollout_correction)
    tis = actor_token_loss(logprobs, entropy, replace(exp, is_weights=weights), replace(plain, kl_loss_coef=0.1))
    torch.testing.assert_close(
        tis.per_token, base.per_token * weights + 0.1 * kl.kl
    )  # the surrogate only, not the KL loss


def make_engines(tiny_model_dir, seed: int, ds_file: str = "tiny_cpu_zero2.json", lora_rank: int = 0):
    """A DeepSpeed actor and critic from the tiny model (``lora_rank``: the actor trains LoRA adapters)."""
    from engine.models.deepspeed_glue import initialize_training_engine, training_ds_config
    from engine.models.loading import load_causal_lm, load_value_model
    from engine.models.lora import add_adapters
    from engine.run_config import LoraSection

    with open(os.path.join(DS_CONFIGS_DIR, ds_file)) as f:
        ds_config = training_ds_config(json.load(f), bf16=False)
    optim = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, lr_scheduler="constant", warmup_steps=0, total_steps=10)
    torch.manual_seed(seed)
    actor = load_causal_lm(str(tiny_model_dir))
    actor = initialize_training_engine(
        add_adapters(actor, LoraSection(rank=lora_rank), causal_lm=True) if lora_rank else actor, ds_config, **optim
    )
    torch.manual_seed(seed)
    critic = initialize_training_engine(load_value_model(str(tiny_model_dir), ["value"]), ds_config, **optim)
    return actor, critic


def parameters(engine) -> list[torch.Tensor]:
    """The full weights (gathered under ZeRO-3)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_partition_weights()):
        return [p.detach().clone() for p in params]


def test_zero3_fetches_whole_decoder_layers_and_steps_as_zero2(deepspeed_ready, tiny_model_dir):
    """Under ZeRO-3 each decoder layer is a DeepSpeed leaf module (one parameter fetch per layer);
    the step it takes is ZeRO-2's. A LoRA actor (frozen embeddings) keeps per-module fetches, and steps."""
    leaves = lambda engine: [m for m in engine.module.modules() if getattr(m, "_z3_leaf", False)]
    lora, critic = make_engines(tiny_model_dir, seed=0, ds_file="tiny_cpu_zero3.json", lora_rank=8)
    exp = random_experience(lora.module.config.vocab_size)
    assert leaves(lora) == [] and len(leaves(critic)) > 1
    adapters = lambda: [p for (name, _), p in zip(lora.module.named_parameters(), parameters(lora)) if ".lora_" in name]
    before = adapters()
    actor_step(
        lora, exp, update_settings(), iteration=0
    )  # as leaves: RuntimeError, a released parameter read in backward
    assert before and any(
        not torch.equal(a, b) for a, b in zip(before, adapters())
    )  # B moves (A's gradient is 0 while B is)
    results = []
    for ds_file in ("tiny_cpu_zero2.json", "tiny_cpu_zero3.json"):
        actor, critic = make_engines(tiny_model_dir, seed=0, ds_file=ds_file)
        for engine in (actor, critic):
            layers = [m for m in engine.module.modules() if type(m).__name__ in engine.module._no_split_modules]
            assert leaves(engine) == (layers if ds_file == "tiny_cpu_zero3.json" else []) and len(layers) > 1
        stats = actor_step(actor, exp, update_settings(), iteration=0) | critic_step(critic, exp, update_settings())
        results.append((stats, parameters(actor) + parameters(critic)))
    (zero2_stats, zero2), (zero3_stats, zero3) = results
    assert all(zero3_stats[k] == pytest.approx(zero2_stats[k], rel=1e-5, abs=1e-7) for k in zero2_stats), (
        zero2_stats,
        zero3_stats,
    )
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(zero2, zero3)])  # Adam's sign steps, as below
    assert diff.mean() < 1e-9 and diff.max() < 1e-4


@pytest.mark.parametrize(
    "max_tokens, aggregation",
    [(14, "token_mean"), (24, "token_mean"), (14, "seq_mean_token_mean"), (14, "seq_mean_token_sum_norm")],
)
def test_real_steps_do_not_depend_on_the_micro_batch_budget(deepspeed_ready, tiny_model_dir, max_tokens, aggregation):
    """actor_step and critic_step on real DeepSpeed engines: one micro-batch, or many of at most
    ``max_tokens`` tokens, give the same update and the same statistics, for each loss aggregation."""
    results = []
    policy = replace(SETTINGS, aggregation=aggregation, norm_tokens=12)
    for budget in (1000, max_tokens):
        actor, critic = make_engines(tiny_model_dir, seed=0)
        exp = random_experience(actor.module.config.vocab_size)
        stats = actor_step(actor, exp, update_settings(budget, policy=policy), iteration=0)
        stats |= critic_step(critic, exp, update_settings(budget))
        # The gradient norm (before clipping) shows the loss scale; Adam's first step hides it.
        stats |= {
            "actor_grad_norm": float(actor.get_global_grad_norm()),
            "critic_grad_norm": float(critic.get_global_grad_norm()),
        }
        results.append((stats, parameters(actor), parameters(critic)))
    (one_stats, one_actor, one_critic), (many_stats, many_actor, many_critic) = results
    assert one_stats.keys() == many_stats.keys()
    assert all(one_stats[k] == pytest.approx(many_stats[k], rel=1e-5, abs=1e-7) for k in one_stats), (
        one_stats,
        many_stats,
    )
    # Adam's first step is ~lr * g / (|g| + eps): a gradient within float noise of eps may move its
    # weight differently, so the weights agree on average over all of them to 1e-9 (per tensor, one
    # such weight in a 128-element norm already crossed it on one machine) and everywhere to a tenth
    # of the lr (1e-3).
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(one_actor + one_critic, many_actor + many_critic)])
    assert diff.mean() < 1e-9 and diff.max() < 1e-4
    start, _ = make_engines(tiny_model_dir, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(parameters(start), one_actor))  # the step did move the actor


@pytest.mark.parametrize("ds_file", ["tiny_cpu_zero2.json", "tiny_cpu_zero3.json"])
def test_values_from_the_first_critic_step_equal_an_experience_forward(deepspeed_ready, tiny_model_dir, ds_file):
    """ppo.old_values_from update: with the rollout as one mini-batch, the first critic step's own
    forward gives the values an experience forward would (same weights), so the values, GAE's
    advantages and returns, two epochs of statistics and the weights after them are the same."""
    gae_settings, world = GaeSettings(gamma=0.99, lam=0.95, whiten=True), torch.distributed.group.WORLD
    results = []
    for from_update in (False, True):
        actor, critic = make_engines(tiny_model_dir, seed=0, ds_file=ds_file)
        exp = random_experience(actor.module.config.vocab_size)
        if from_update:
            exp.old_values, exp.advantages, exp.returns = (torch.zeros_like(exp.rewards) for _ in range(3))
        else:
            critic.eval()
            with torch.no_grad():
                exp.old_values = pad_right(
                    sequence_values(critic, exp.sequences, exp.prompt_lens, ValueReadout(torch.ones(1)), 24, 0, True),
                    exp.mask.shape[1],
                )
            exp.advantages, exp.returns = estimate_advantages(
                "gae", exp.rewards, exp.old_values, exp.mask, 0.99, 0.95, 1, True, group=world
            )
        stats = update_on_rollout(
            actor,
            critic,
            exp,
            update_settings(ppo_epochs=2, values_gae=gae_settings if from_update else None),
            iteration=0,
            train_actor=True,
            after_step=lambda engine, name: None,
        )
        results.append((exp, stats, parameters(actor) + parameters(critic)))
    (want, want_stats, want_weights), (got, got_stats, got_weights) = results
    assert want.old_values[want.mask].abs().min() > 0  # real values, not the placeholders
    for field in ("old_values", "advantages", "returns"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), atol=1e-5, rtol=0)
    assert all(got_stats[k] == pytest.approx(want_stats[k], rel=1e-5, abs=1e-6) for k in want_stats), (
        want_stats,
        got_stats,
    )
    diff = torch.cat(
        [(a - b).abs().flatten() for a, b in zip(want_weights, got_weights)]
    )  # Adam's sign steps, as above
    assert diff.mean() < 1e-9 and diff.max() < 1e-4
    actor, critic = make_engines(tiny_model_dir, seed=0, ds_file=ds_file)
    with pytest.raises(ValueError, match="one mini-batch"):
        update_on_rollout(
            actor,
            critic,
            random_experience(50),
            update_settings(mini_batch_size=4, values_gae=gae_settings),
            iteration=0,
            train_actor=True,
            after_step=lambda engine, name: None,
        )


def test_dropout_anywhere_means_train_mode_differs(tiny_model_dir):
    from engine.models.loading import load_value_model, trains_as_it_evaluates

    model = load_value_model(str(tiny_model_dir), ["value"])
    assert trains_as_it_evaluates(model)
    model.config.attention_dropout = 0.1
    assert not trains_as_it_evaluates(model)
    model.config.attention_dropout = 0.0
    model.dropout.p = 0.1  # the token-classification head's
    assert not trains_as_it_evaluates(model)
