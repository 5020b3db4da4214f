"""What a PPO run checks and loads before any model does: the prompts that fit (with the columns
the rewards read), the actor's and reward model's tokenizers once their directories are found
usable, the rewards section's components (the code sandbox's isolation among their checks) and the
environment's runner, with their workers started and checked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from engine.data.chat import Message, rerendering_difference, shares_template
from engine.data.prompts import Prompt, load_prompts, prompts_that_fit
from engine.environments.episodes import EpisodeRunner, TemplateCannotObserve
from engine.ppo.dataset_responses import DatasetResponses
from engine.rewards.code_tests import check_column
from engine.rewards.components import RewardComponents, RewardsConfigError
from engine.rewards.sandbox import describe_isolation
from engine.run.launch import RunRefused
from engine.run.preflight import (
    check_data_templates,
    check_lora_targets,
    check_reward_model,
    check_shared_vocabulary,
    check_vllm_can_run,
    check_weights,
    load_tokenizer,
)
from engine.run_config import PPOConfig
from engine.run_config.rewards import RewardsSection


def load_fitting_prompts(path: str, tokenizer, cfg: PPOConfig, rank: int, held_out: bool = False) -> list[Prompt]:
    """The prompts of ``path``, with the columns the rewards read (``held_out``: the judge's too; the
    code reward's tests must parse; else with distill.lmbda < 1 the dataset responses' column), that
    leave room for a response of rollout.max_new_tokens within a micro-batch and, with vLLM, its
    context (the others are dropped and counted)."""
    room = min(
        cfg.ppo.max_tokens_per_micro_batch, cfg.rollout.vllm_max_model_len if cfg.rollout.sampler == "vllm" else 1 << 62
    )
    judge = cfg.judge.rewards if held_out else None
    environment = cfg.rollout.environment
    columns = dict.fromkeys(environment.fields, "rollout.environment.fields") if environment else {}
    if cfg.distill is not None and cfg.distill.lmbda < 1 and not held_out:
        columns[cfg.distill.response_field] = "distill.response_field"
    prompts = load_prompts(path, columns | cfg.rewards.fields() | (judge.fields("judge.rewards") if judge else {}))
    for code in (c for c in (cfg.rewards.code, judge and judge.code) if c):
        check_column(path, code.field, [p.fields[code.field] for p in prompts])
    prompts, dropped = prompts_that_fit(prompts, tokenizer, room - cfg.rollout.max_new_tokens)
    if dropped and rank == 0:
        print(
            f"{path}: dropped {dropped} of {len(prompts) + dropped} prompts longer than "
            f"{room - cfg.rollout.max_new_tokens} tokens (the smaller of ppo.max_tokens_per_micro_batch and "
            "rollout.vllm_max_model_len, less rollout.max_new_tokens)"
        )
    return prompts


def dataset_responses(cfg: PPOConfig, prompts: Sequence[Prompt], tokenizer) -> DatasetResponses | None:
    """The training prompts' dataset responses, tokenised, with distill.lmbda < 1 (else None)."""
    distill = cfg.distill
    if distill is None or distill.lmbda == 1:
        return None
    return DatasetResponses(
        cfg.data.prompts,
        prompts,
        distill.response_field,
        tokenizer,
        cfg.rollout.max_new_tokens,
        distill.lmbda,
        cfg.train.seed,
    )


class Tokenizers(NamedTuple):
    actor: PreTrainedTokenizerBase
    reward_model: PreTrainedTokenizerBase | None  # None without a reward model
    judge: PreTrainedTokenizerBase | None  # the judge's reward model's, None without one


def check_models(cfg: PPOConfig) -> Tokenizers:
    """The models' tokenizers, once the model directories are found usable (whole weight files that
    fit their configs, trained reward models, a teacher that shares the actor's vocabulary, LoRA targets
    that exist, a model vLLM can run), before any model loads."""
    actor = cfg.actor
    tokenizer = load_tokenizer(
        actor.path, "actor.path", actor.trust_remote_code, actor.chat_template, "actor.chat_template"
    )
    data = {"data.prompts": cfg.data.prompts, "data.eval_prompts": cfg.data.eval_prompts}
    check_data_templates(tokenizer, data, "actor.chat_template")
    check_weights(cfg.actor.path, "actor.path", value_head=False, trust_remote_code=cfg.actor.trust_remote_code)
    reward_tokenizers = []
    for key, rm in (("reward_model", cfg.reward_model), ("judge.reward_model", cfg.judge.reward_model)):
        reward_tokenizers.append(load_tokenizer(rm.path, f"{key}.path") if rm else None)
        if rm:
            check_reward_model(rm.path, f"{key}.path", rm.normalize)
            check_weights(rm.path, f"{key}.path", value_head=True)  # the critic starts from the actor's or the RM's
    if cfg.distill is not None:
        remote_code = cfg.actor.trust_remote_code
        check_shared_vocabulary(cfg.distill.teacher, "distill.teacher", tokenizer, remote_code)
        check_weights(cfg.distill.teacher, "distill.teacher", value_head=False, trust_remote_code=remote_code)
    check_lora_targets(cfg.actor.path, "actor.lora", cfg.actor.lora, False, cfg.actor.trust_remote_code)
    check_lora_targets(cfg.critic_source().path, "critic.lora", cfg.critic.lora, True)
    if cfg.rollout.sampler == "vllm":
        check_vllm_can_run(cfg.actor.path, "actor.path", cfg.actor.trust_remote_code, cfg.rollout.tensor_parallel_size)
    return Tokenizers(tokenizer, *reward_tokenizers)


def reward_model_inputs(tokenizers: Tokenizers, prompt: list[Message]) -> list[str]:
    """What each reward model of the run reads of a sampled response, a line each (the dry run and
    the start print them): the sampled ids where it shares the actor's tokenizer and chat template
    (and where re-rendering the decoded text would have changed them, tried on ``prompt``), else
    the decoded text through its own template."""
    lines = []
    for key, reader in (("reward_model", tokenizers.reward_model), ("judge.reward_model", tokenizers.judge)):
        if reader is None:
            continue
        if not shares_template(tokenizers.actor, reader):
            lines.append(
                f"{key} reads the decoded text rendered through its own chat template (its tokenizer or "
                "template is not the actor's)"
            )
            continue
        line = f"{key} reads the sampled token ids (it shares the actor's tokenizer and chat template)"
        if difference := rerendering_difference(reader, prompt):
            line += f"; re-rendering the decoded text instead would change them: {difference}"
        lines.append(line)
    return lines


def started_components(cfg: PPOConfig, section: RewardsSection | None, key: str = "rewards") -> RewardComponents | None:
    """A rewards section's components (the section at dotted ``key``), their worker pool started and
    checked (functions import and take their arguments, the server serves the components named);
    None without components."""
    if section is None or not section.weights():
        return None
    components = RewardComponents(section, cfg.rollout.max_new_tokens)
    try:
        components.check(key)
    except RewardsConfigError as e:
        components.close()
        raise RunRefused("config", f"{cfg._source}: {e}") from None
    return components


def reward_components(cfg: PPOConfig) -> tuple[RewardComponents | None, RewardComponents | None]:
    """The started components of the rewards section and of the judge's, before any model loads."""
    rewards = started_components(cfg, cfg.rewards)
    try:
        return rewards, started_components(cfg, cfg.judge.rewards, "judge.rewards")
    except RunRefused:
        if rewards is not None:
            rewards.close()
        raise


def episode_runner(cfg: PPOConfig, tokenizer: PreTrainedTokenizerBase) -> EpisodeRunner | None:
    """The multi-turn runner of ``rollout.environment``, its workers started and the environment
    imported, before any model loads; None without an environment."""
    section = cfg.rollout.environment
    if section is None:
        return None
    try:
        runner = EpisodeRunner(section, tokenizer, cfg.rewards.import_timeout_s)
    except TemplateCannotObserve as e:
        raise RunRefused("config", f"{cfg._source}: 'rollout.environment' with '{cfg.actor.path}': {e}") from None
    if error := runner.check():
        runner.close()
        raise RunRefused("config", f"{cfg._source}: 'rollout.environment.name' ({section.name}): {error}")
    return runner


def code_sandbox(components: Sequence[RewardComponents | None]) -> list[str]:
    """The code sandbox's isolation, as the components' check probed it, in one line (none without a
    ``code`` component): the dry run prints it, a run logs it as an event."""
    return sorted({describe_isolation(c.isolation) for c in components if c is not None and c.isolation})
