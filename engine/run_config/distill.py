"""The ``distill`` section of a PPO run: on-policy distillation from a frozen teacher model into the
actor, on the actor's own samples, and with GKD's ``lmbda`` < 1 on the dataset's responses too (the
formulas: engine/ppo/distill_losses.py; the draw: engine/ppo/dataset_responses.py)."""

from __future__ import annotations

from typing import Literal

from engine.config import Config, ConfigError, option, required

DistillMode = Literal["reverse_kl", "gkd"]


class DistillSection(Config):
    teacher: str = required(
        "HF model directory of the teacher, frozen (ZeRO-3 like the reference); it must share the actor's tokenizer"
    )
    mode: DistillMode = option(
        "reverse_kl",
        "reverse_kl: each sampled token's advantage gets - coef * (log pi_actor - log pi_teacher); gkd: the loss "
        "gets coef x the generalised JSD(beta) between the actor and the teacher over the teacher's top_k tokens",
    )
    coef: float = option(1.0, "weight of the distillation term (in the advantages or in the loss)", gt=0)
    beta: float = option(
        0.5,
        "gkd: the JSD's interpolation (0: forward KL(teacher || actor), 1: reverse KL(actor || teacher))",
        ge=0,
        le=1,
    )
    lmbda: float = option(
        1.0,
        "gkd: the probability that an iteration's responses are sampled by the actor (on-policy); the other "
        "iterations take the prompt file's response_field column (the dataset's responses), with no policy gradient",
        ge=0,
        le=1,
    )
    response_field: str = option(
        "response",
        "gkd with lmbda < 1: the prompt file's column holding each prompt's dataset response (text), e.g. written by "
        "data_prep/prepare_prompts.py --fields response",
    )
    top_k: int = option(
        32, "gkd: the teacher's likeliest tokens per position the JSD is taken over (the rest: one bucket)", ge=1
    )

    def check(self) -> None:
        gkd_only = {"beta", "lmbda", "response_field", "top_k"}
        unread = sorted(self.model_fields_set & gkd_only) if self.mode == "reverse_kl" else []
        if unread:
            raise ConfigError(f"{', '.join(map(repr, unread))}: mode gkd's; mode reverse_kl reads none of them")
        if self.lmbda == 1 and "response_field" in self.model_fields_set:
            raise ConfigError(
                f"'response_field' ({self.response_field}): read only with lmbda < 1 (dataset responses); lmbda is 1"
            )
