"""The config of train/train_ppo.py: the actor, reward model, critic, rollout, PPO, schedule, guard
and monitor sections, and the cross-field rules between them."""

from __future__ import annotations

from typing import ClassVar, Literal, NamedTuple

from engine.config import Config, ConfigError, DeepSpeedDict, option, required, section
from engine.run_config.common import (
    MAX_SEED,
    CheckpointSection,
    GuardsSection,
    LoggingSection,
    LoraSection,
    OptimSection,
    PolicySection,
    resolve_deepspeed_dtype,
)
from engine.run_config.distill import DistillSection
from engine.run_config.monitors import JudgeSection, MonitorSection
from engine.run_config.rewards import RewardModelSection, RewardsSection
from engine.run_config.rollout import RolloutSection
from engine.run_config.rollout_correction import RolloutCorrectionSection

# The names PPO's formulas take (engine/ppo/losses.py), defined once here where the config offers them.
KLEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
AdvantageEstimator = Literal["gae", "grpo", "rloo", "reinforce_pp"]


class CriticSection(Config):
    init_from: Literal["reward_model", "actor"] = option("reward_model", "initial weights of the critic's backbone")
    lr: float = option(5e-6, "critic learning rate (the schedule and betas follow 'optim')", gt=0)
    warmup_iterations: int = option(0, "first iterations train the critic only", ge=0)
    lora: LoraSection = section(LoraSection, "LoRA adapters on the critic's backbone (its value head is trained whole)")


class PPODataSection(Config):
    prompts: str = required("prompts parquet for rollouts (prepare_preferences.py: prompts_train.parquet)")
    eval_prompts: str = option("", "held-out prompts parquet, scored every eval_every iterations")


class PPOSection(Config):
    retired_keys: ClassVar[dict[str, str]] = {
        "tis_cap": 'replaced by ppo.rollout_correction: tis_cap C is {"level": "token", "mode": "truncate", "high": C}'
    }

    ppo_epochs: int = option(1, "passes over each rollout batch", ge=1)
    mini_batch_size: int = option(16, "samples per optimizer step, over all ranks", ge=1)
    max_tokens_per_micro_batch: int = option(2048, "token budget of one packed forward on one rank", ge=2)
    clip_ratio: float = option(0.2, "PPO clip range (lower side)", gt=0, lt=1)
    clip_ratio_high: float | None = option(None, "upper clip range if asymmetric (None: clip_ratio)", gt=0)
    clip_ratio_c: float | None = option(None, "dual-clip bound for negative advantages, e.g. 3.0 (None: off)", gt=1)
    importance_ratio: Literal["token", "sequence"] = option(
        "token",
        "the policy ratio clipped: per token (PPO), or per sequence, the length-normalised product of its token "
        "ratios (GSPO; its paper clips at 3e-4 / 4e-4 with loss_aggregation seq_mean_token_mean)",
    )
    value_clip: float = option(0.2, "value-function clip range around the old values", gt=0)
    gamma: float = option(1.0, "discount", ge=0, le=1)
    lam: float = option(0.95, "GAE lambda", ge=0, le=1)
    kl_estimator: KLEstimator = option(
        "k1", "estimator of the KL in the reward (k1: the log-ratio, unbiased per token)"
    )
    use_kl_in_reward: bool = option(True, "subtract kl_coef * KL from the per-token reward")
    kl_coef: float = option(0.05, "KL coefficient (initial value when adaptive)", ge=0)
    kl_target: float | None = option(
        None,
        "adaptive KL controller target, in KL per response token like guards.kl_ceiling "
        "(e.g. 0.05; None: fixed kl_coef)",
        gt=0,
    )
    kl_horizon: int = option(10000, "adaptive KL controller horizon, in samples", ge=1)
    kl_loss_coef: float = option(0.0, "weight of a KL loss term in the actor loss (GRPO style)", ge=0)
    kl_loss_estimator: KLEstimator = option(
        "k3", "estimator of the KL loss (k3: non-negative, low variance; with k1 the loss has ~zero expected gradient)"
    )
    entropy_coef: float = option(0.0, "entropy bonus in the actor loss", ge=0)
    advantage_estimator: AdvantageEstimator = option(
        "gae",
        "gae (with a critic); critic-free, no critic engine: grpo (group mean/std), rloo (leave-one-out), "
        "reinforce_pp (global baseline)",
    )
    whiten_advantages: bool = option(True, "standardise GAE advantages over the rollout batch (all ranks)")
    grpo_std_scaling: bool = option(
        True, "grpo: divide by the group's reward std (false: Dr. GRPO, the group mean subtracted only)"
    )
    loss_aggregation: LossAggregation = option(
        "token_mean",
        "the actor loss over a mini-batch: token_mean (every response token alike; DAPO), seq_mean_token_mean "
        "(each sequence's token mean, then the mean over sequences; GRPO), seq_mean_token_sum_norm (each "
        "sequence's token sum / loss_norm_tokens, then the mean; Dr. GRPO)",
    )
    mask_truncated: bool = option(
        False, "responses cut at rollout.max_new_tokens count in no loss (DAPO's overlong filtering)"
    )
    loss_norm_tokens: int | None = option(
        None, "seq_mean_token_sum_norm's constant (None: rollout.max_new_tokens)", ge=1
    )
    old_logprobs_from: Literal["actor", "sampler"] = option(
        "actor",
        "PPO's old log-probs: the actor's experience forward, or the sampler's own (fp32 only; one forward fewer per "
        "iteration; checked against the actor every sampler_check_every iterations, back to the actor for good when "
        "the gap is above sampler_logprob_tolerance)",
    )
    old_values_from: Literal["update", "experience"] = option(
        "update",
        "the critic's values at sampling time (GAE's baseline): update: the first critic step's own forward, on the "
        "same weights (exact; one forward fewer per iteration), used where it is the same: the rollout is one "
        "mini-batch (mini_batch_size = prompts_per_iteration x samples_per_prompt) and the critic has no dropout; "
        "experience: always an experience forward",
    )
    share_prompt: bool = option(
        True,
        "compute a prompt once for all its samples (samples_per_prompt) in the experience and training forwards "
        "(exact; used with attention sdpa_varlen, the default on CPUs and on GPUs without flash-attn)",
    )
    rollout_correction: RolloutCorrectionSection | None = option(
        None,
        "importance weights pi_actor / pi_sampler on the policy loss, for a sampler whose numerics differ from the "
        "trainer's (bf16, GPU kernels) or whose weights are behind (rollout.mode async); e.g. {} for token ratios "
        "truncated at 2 (None: off)",
    )
    sampler_check_every: int = option(
        10, "with old_logprobs_from sampler: compute both every N iterations (the first included)", ge=1
    )
    sampler_logprob_tolerance: float = option(
        1e-4,
        "with old_logprobs_from sampler: the largest mean |sampler - actor| log-prob gap that counts as the same",
        gt=0,
    )


class PPOTrainSection(Config):
    iterations: int = option(20, "rollout + update iterations", ge=1)
    eval_every: int = option(0, "score held-out prompts every N iterations (0: start and end only)", ge=0)
    seed: int = option(0, "seed of prompt order, sampling and initialisation", ge=0, le=MAX_SEED)


class PPOGuardsSection(GuardsSection):
    kl_ceiling: float | None = option(
        None, "rollout KL per token above which the actor LR is lowered (e.g. 0.1; None: off)", gt=0
    )
    kl_lr_factor: float = option(0.5, "multiply the actor LR by this each time the KL is above kl_ceiling", gt=0, le=1)
    rollback_drop: float | None = option(
        None,
        "roll back when the held-out reward falls this fraction of |best| below the best (e.g. 0.05; None: off)",
        gt=0,
    )
    rollback_min_drop: float = option(
        0.0, "... and by at least this much (absolute; rewards near 0 make fractions noisy)", ge=0
    )
    rollback_lr_factor: float = option(0.5, "multiply the actor LR by this after a rollback", gt=0, le=1)
    max_rollbacks: int = option(2, "give up (exit 3) at the drop after this many rollbacks", ge=0)


class CriticSource(NamedTuple):
    """The model a PPO critic starts from, and its value head."""

    path: str  # model directory
    # the value head's outputs; None: the reward model's head, kept (the value is the weighted total of its components)
    components: list[str] | None


class PPOConfig(Config):
    """Config of train/train_ppo.py."""

    actor: PolicySection = required("policy to train (also the frozen reference)")
    reward_model: RewardModelSection | None = option(None, "frozen reward model (None: the rewards section alone)")
    data: PPODataSection = required("prompts")
    deepspeed: DeepSpeedDict = required("DeepSpeed config of the trained models (ZeRO-3 for the hybrid engine)")
    rewards: RewardsSection = section(RewardsSection, "score components besides the reward model, and how they run")
    critic: CriticSection = section(CriticSection, "value model")
    rollout: RolloutSection = section(RolloutSection, "generation")
    ppo: PPOSection = section(PPOSection, "PPO hyper-parameters")
    train: PPOTrainSection = section(PPOTrainSection, "schedule")
    optim: OptimSection = section(OptimSection, "actor optimizer and learning-rate schedule")
    checkpoint: CheckpointSection = section(CheckpointSection, "resumable checkpoints (every_steps counts iterations)")
    guards: PPOGuardsSection = section(PPOGuardsSection, "training guards: NaN steps, KL ceiling, rollback")
    monitors: MonitorSection = section(MonitorSection, "reward-hacking monitors on held-out responses")
    judge: JudgeSection = section(JudgeSection, "held-out scores the policy is not trained on (a reward-hacking check)")
    distill: DistillSection | None = option(
        None, "on-policy distillation from a frozen teacher on the actor's samples (None: off); the reward is optional"
    )
    logging: LoggingSection = section(LoggingSection, "where and how to log")

    def check(self) -> None:
        self.actor.bf16 = resolve_deepspeed_dtype(self.deepspeed, self.actor.bf16, "actor.bf16")
        if self.guards.rollback_drop is not None and not (self.data.eval_prompts and self.train.eval_every):
            raise ConfigError(
                "guards.rollback_drop needs data.eval_prompts and train.eval_every > 0 (the held-out reward it watches)"
            )
        if self.ppo.importance_ratio == "sequence" and self.ppo.clip_ratio_c is not None:
            raise ConfigError(
                "ppo.clip_ratio_c (dual clip) caps token ratios; ppo.importance_ratio sequence (GSPO) has one ratio "
                "per sequence: drop one"
            )
        if self.monitors.action == "rollback" and self.guards.rollback_drop is None:
            raise ConfigError(
                "monitors.action rollback returns to the last good evaluation, which guards.rollback_drop keeps: set it"
            )
        if self.judge.active() and not self.data.eval_prompts:
            raise ConfigError("judge scores held-out responses: set data.eval_prompts")
        if (
            self.reward_model is None
            and not self.rewards.weights()
            and self.rollout.environment is None
            and self.distill is None
        ):
            raise ConfigError(
                "nothing to score responses with: set reward_model.path, a rewards component, rollout.environment "
                "or distill (a teacher)"
            )
        if self.has_critic() and self.critic.init_from == "reward_model" and self.reward_model is None:
            raise ConfigError("critic.init_from reward_model needs a reward_model: set critic.init_from actor")
        length = self.rewards.length
        if length and length.target_tokens >= self.rollout.max_new_tokens:
            raise ConfigError(
                f"rewards.length.target_tokens ({length.target_tokens}) must be below rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}), where the penalty reaches -1"
            )
        estimator = self.ppo.advantage_estimator
        if estimator in ("grpo", "rloo") and self.rollout.samples_per_prompt < 2:
            raise ConfigError(
                f"ppo.advantage_estimator {estimator} compares the samples of a prompt: "
                "set rollout.samples_per_prompt >= 2"
            )
        if self.rollout.dynamic_sampling and estimator not in ("grpo", "rloo"):
            raise ConfigError(
                f"rollout.dynamic_sampling drops the prompts whose samples score alike, which carry no signal under a "
                f"group estimator; ppo.advantage_estimator {estimator} still learns from them: set grpo or rloo"
            )
        if not self.has_critic() and self.critic.warmup_iterations:
            raise ConfigError(
                f"critic.warmup_iterations needs a critic, and ppo.advantage_estimator {estimator} has none: "
                "set it to 0"
            )
        if self.ppo.rollout_correction is not None and self.ppo.old_logprobs_from == "sampler":
            raise ConfigError(
                "ppo.rollout_correction corrects the gap between the sampler's and the actor's log-probs; with "
                "ppo.old_logprobs_from sampler the old log-probs are the sampler's and every ratio is 1: drop one"
            )
        if self.ppo.old_logprobs_from == "sampler" and self.rollout.mode == "async" and self.rollout.max_staleness:
            raise ConfigError(
                "ppo.old_logprobs_from sampler takes the behaviour policy's log-probs as PPO's; with rollout.mode "
                "async the sampler is up to rollout.max_staleness updates behind: set actor "
                "(ppo.rollout_correction corrects)"
            )
        if self.ppo.old_logprobs_from == "sampler" and self.actor.bf16:
            raise ConfigError(
                "ppo.old_logprobs_from sampler needs fp32 weights (actor.bf16 false): in bf16 the sampler's kernels "
                "round otherwise than the actor's, so PPO must recompute the old log-probs"
            )
        if self.rollout.prompts_per_iteration * self.rollout.samples_per_prompt % self.ppo.mini_batch_size:
            raise ConfigError(self._mini_batch_rule())
        if self.distill is not None and self.distill.lmbda < 1:
            self._check_dataset_responses(self.distill.lmbda)

    def _check_dataset_responses(self, lmbda: float) -> None:
        """What an iteration of the dataset's responses (distill.lmbda < 1: no sampler, no policy
        gradient, one response per prompt) cannot go with."""
        why = f"distill.lmbda ({lmbda:g}) < 1: some iterations train on the dataset's responses, not sampled ones"
        for broken, conflict in (
            (
                self.has_critic(),
                f"with ppo.advantage_estimator {self.ppo.advantage_estimator} the critic would learn their returns as "
                "the actor's: set grpo, rloo or reinforce_pp",
            ),
            (self.rollout.dynamic_sampling, "rollout.dynamic_sampling would drop their groups (alike): set it false"),
            (self.rollout.environment is not None, "rollout.environment's episodes have none: drop one"),
            (
                self.ppo.old_logprobs_from == "sampler",
                "ppo.old_logprobs_from sampler has no sampler log-probs for them: set actor",
            ),
        ):
            if broken:
                raise ConfigError(f"{why}; {conflict}")

    def has_critic(self) -> bool:
        """GAE needs a critic; a critic-free ppo.advantage_estimator builds, trains and saves none."""
        return self.ppo.advantage_estimator == "gae"

    def critic_source(self) -> CriticSource:
        """Where the critic's weights start (critic.init_from), whether or not the run has one
        (:meth:`has_critic`): its LoRA targets are checked and the dry run prices what it saves."""
        if self.critic.init_from == "reward_model" and self.reward_model is not None:
            return CriticSource(self.reward_model.path, None)
        return CriticSource(self.actor.path, ["value"])

    def generation_ranks(self) -> int:
        """The ranks that only generate: one vLLM engine's with rollout.mode async, else none."""
        return self.rollout.tensor_parallel_size if self.rollout.mode == "async" else 0

    def check_world_size(self, world: int) -> None:
        """The batch shapes against the number of ranks (the training ranks', with rollout.mode async)."""
        generating = self.generation_ranks()
        if world <= generating:
            raise ConfigError(
                f"{self._source}: config: rollout.mode async needs more than rollout.tensor_parallel_size "
                f"({generating}) ranks: those generate, the others train"
            )
        world -= generating
        tp, prompts = self.rollout.tensor_parallel_size, self.rollout.prompts_per_iteration
        for broken, message in (
            (not generating and world % tp, f"rollout.tensor_parallel_size ({tp}) must divide the {world} ranks"),
            (prompts % world, f"rollout.prompts_per_iteration ({prompts}) must divide over {world} ranks"),
            (self.ppo.mini_batch_size % world, f"{self._mini_batch_rule()}, and be divisible by {world} ranks"),
        ):
            if broken:
                raise ConfigError(f"{self._source}: config: {message}")

    def _mini_batch_rule(self) -> str:
        rollout = self.rollout.prompts_per_iteration * self.rollout.samples_per_prompt
        return (
            f"ppo.mini_batch_size ({self.ppo.mini_batch_size}) must divide the rollout batch, "
            f"rollout.prompts_per_iteration x rollout.samples_per_prompt ({self.rollout.prompts_per_iteration} x "
            f"{self.rollout.samples_per_prompt} = {rollout})"
        )
