"""What a PPO run decides between iterations (:class:`IterationControls`): the KL coefficient, where the
old log-probs come from, the guards (non-finite steps, the KL ceiling, rollback on a held-out drop, the
sampler's log-prob gap), the reward-hacking monitors and their actions, the held-out evaluation's
schedule, and the checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from engine.ppo.evaluation import held_out_summary
from engine.ppo.experience import OldLogprobSource
from engine.ppo.iteration import IterationResult, IterationSettings
from engine.ppo.losses import AdaptiveKLController, FixedKLController
from engine.ppo.monitors import HackingMonitor, MonitorLimits, act_on_flags
from engine.rollout.remote import WeightSyncFailed
from engine.run.guards import KLGuard, NonFiniteGuard, RollbackGuard

if TYPE_CHECKING:
    from engine.run.lifecycle import RunLifecycle
    from engine.run_config import PPOConfig

Evaluate = Callable[[], dict[str, float]]  # the held-out eval/* metrics of the policy now


@dataclass(frozen=True)
class SamplerGapLimit:
    """The colocated counterpart of an async rollout's sync check (engine/rollout/remote.py): an
    iteration's mean per-token |sampler - actor| log-prob gap (``ppo/sampler_logprob_gap``, agreed over
    the ranks) above ``tolerance`` means the sampler does not compute the actor's model (a broken weight
    sync), and the run stops (:class:`WeightSyncFailed`: a checkpoint, exit 2). ``tolerance`` None: no
    limit; an async rollout's samples come from earlier weights, so their gap also holds the updates since
    (dynamic sampling's groups that waited from an earlier iteration count in no gap: engine/ppo/experience.py)."""

    tolerance: float | None

    @classmethod
    def from_config(cls, cfg: PPOConfig) -> SamplerGapLimit:
        """``rollout.sync_check_tolerance`` when the measured samples come from the weights of the last sync."""
        return cls(cfg.rollout.sync_check_tolerance if cfg.rollout.mode == "colocated" else None)

    def check(self, gap: float | None, iteration: int) -> None:
        """Stop on 1-based ``iteration``'s ``gap`` (None: not measured, the old log-probs were the
        sampler's) above the tolerance, or not a number."""
        if self.tolerance is None or gap is None or gap <= self.tolerance:
            return
        raise WeightSyncFailed(
            f"the sampler's log-probs of iteration {iteration}'s responses differ from the actor's by {gap:.3g} per "
            f"token (rollout.sync_check_tolerance {self.tolerance:g}): the sampler does not compute the actor's model"
        )


class IterationControls:
    """The run's controls, each saved in its checkpoints (``run.track``). Call :meth:`evaluate_start`
    before the first iteration, :meth:`settings` before each and :meth:`end_iteration` after it."""

    def __init__(self, cfg: PPOConfig, run: RunLifecycle, actor_engine, evaluate: Evaluate | None):
        self.cfg, self.run, self.actor_engine, self.evaluate = cfg, run, actor_engine, evaluate
        ppo, guards = cfg.ppo, cfg.guards
        self.kl_ctl = (
            AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
            if ppo.kl_target is not None
            else FixedKLController(ppo.kl_coef)
        )
        self.nonfinite, self.kl_guard = NonFiniteGuard(guards.max_nonfinite_in_a_row), KLGuard(guards.kl_ceiling)
        self.rollback = RollbackGuard(guards.rollback_drop, guards.rollback_min_drop, guards.max_rollbacks)
        self.monitor = HackingMonitor(MonitorLimits.from_config(cfg))
        self.old_logprobs = OldLogprobSource(
            ppo.old_logprobs_from, ppo.sampler_check_every, ppo.sampler_logprob_tolerance
        )
        self.sampler_gap = SamplerGapLimit.from_config(cfg)
        run.track("kl_controller", self.kl_ctl, rolls_back=True)
        for name, guard in (("nonfinite", self.nonfinite), ("kl_guard", self.kl_guard), ("monitor", self.monitor)):
            run.track(name, guard, rolls_back=False)
        run.track_rollback(self.rollback, lr_factor=guards.rollback_lr_factor)
        run.track("old_logprobs", self.old_logprobs, rolls_back=False)
        self.first: dict[str, float] | None = None  # the starting point's held-out metrics
        self.last: dict[str, float] = {}  # the last iteration's metrics

    def evaluate_start(self) -> None:
        """The held-out evaluation of the starting point (not on resume): logged, checked by the monitors
        (a warning at most) and the first rollback target."""
        if self.evaluate is None or self.run.resume_from:
            return
        self.first = self.evaluate()
        self.run.logger.log(0, self.first)
        act_on_flags(self.monitor.check_evaluation(0, self.first), self.monitor, self.run, "warn")
        self.run.first_evaluation(self.first["eval/reward"])

    def settings(self) -> IterationSettings:
        step = self.run.step
        return IterationSettings(
            kl_coef=self.kl_ctl.value if self.cfg.ppo.use_kl_in_reward else 0.0,
            old_from_sampler=self.old_logprobs.use_sampler(step),
            train_actor=step >= self.cfg.critic.warmup_iterations,
            after_step=partial(self.run.check_step, self.nonfinite, step + 1),
        )

    def end_iteration(self, result: IterationResult) -> None:
        """After an iteration: the old log-probs' source and the KL coefficient updated, the KL guard, the
        held-out evaluation when it is due, the log, then a stop on the sampler's log-prob gap
        (:class:`SamplerGapLimit`), the monitors' action, a rollback on a held-out drop, or the
        lifecycle's save decisions (a good evaluation is a rollback target)."""
        cfg, run = self.cfg, self.run
        if message := self.old_logprobs.observe(result.sampler_logprob_gap):
            run.event("old_logprobs_from_actor", message, step=run.step + 1)
        rollout = cfg.rollout
        self.kl_ctl.update(result.kl_per_token, n_steps=rollout.prompts_per_iteration * rollout.samples_per_prompt)
        run.step += 1
        if self.kl_guard.exceeded(result.kl_per_token):
            run.scale_lr(cfg.guards.kl_lr_factor)
            run.event(
                "kl_guard",
                f"KL {result.kl_per_token:.4f} per token is above the ceiling "
                f"{cfg.guards.kl_ceiling}: actor LR x{cfg.guards.kl_lr_factor}",
            )
        metrics = result.metrics | {
            "ppo/kl_coef": self.kl_ctl.value,
            "ppo/actor_lr": self.actor_engine.get_lr()[0],
            "guard/nonfinite_skipped": self.nonfinite.skipped,
            "guard/kl_guard_hits": self.kl_guard.hits,
            "guard/rollbacks": self.rollback.rollbacks,
        }
        every = cfg.train.eval_every
        evaluated = self.evaluate is not None and (
            (every and run.step % every == 0) or run.step == cfg.train.iterations
        )
        flags = self.monitor.check_iteration(run.step, metrics)
        if self.evaluate is not None and evaluated:
            metrics |= self.evaluate()
            flags += self.monitor.check_evaluation(run.step, metrics)
        run.log(
            metrics,
            score=f"{metrics['ppo/score']:.3f}",
            kl=f"{metrics['ppo/kl']:.4f}",
            it_s=f"{metrics['timing/iteration_s']:.2f}",
        )
        self.last = metrics
        self.sampler_gap.check(result.sampler_logprob_gap, run.step)
        if act_on_flags(flags, self.monitor, run, cfg.monitors.action):
            return
        if evaluated and run.rolled_back(metrics["eval/reward"]):
            return
        run.end_of_step(good=bool(evaluated) and not self.monitor.active)  # a rollback target raises no flag

    def summary(self) -> str:
        """The run's closing line (before where the actor was saved): the monitors' flags, the last KL, the
        held-out reward before and after."""
        monitor, metrics = self.monitor, self.last
        line = (
            f"ppo {f'finished with {monitor.summary()};' if monitor.raised else 'done:'} {self.cfg.train.iterations} "
            f"iterations, last KL {metrics['ppo/kl_per_token']:.4f} per token"
        )
        if self.first and "eval/reward" in metrics:
            line += f"; {held_out_summary(self.first, metrics)}"
        return line
