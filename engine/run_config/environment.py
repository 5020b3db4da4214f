"""The ``rollout.environment`` section of train/train_ppo.py's config: multi-turn episodes with an
environment (engine/environments/environment.py, engine/environments/episodes.py)."""

from __future__ import annotations

from engine.config import Config, ConfigError, option, required


class EnvironmentSection(Config):
    name: str = required(
        "'module:Class' of an engine.environments.environment.Environment subclass, one instance per episode, run "
        "in worker processes (the module is found from the working directory); e.g. "
        "engine.environments.tools:ToolEnvironment"
    )
    fields: list[str] = option([], "prompt-data columns passed to the environment's reset as keyword arguments")
    max_turns: int = option(4, "the policy's turns per episode at most", ge=1)
    max_observation_tokens: int = option(256, "an observation's content is cut to this many tokens", ge=1)
    observation_role: str = option("tool", "the chat-template role an observation is rendered as")
    timeout_s: float = option(10.0, "timeout of one call of the environment (reset, step)", gt=0)
    workers: int = option(2, "environment worker processes per rank", ge=1)
    weight: float = option(1.0, "weight of the episode's summed rewards in the score (reward/environment)")
    fallback: float = option(0.0, "the reward of an episode whose environment raised or timed out")

    def check(self) -> None:
        module, _, name = self.name.partition(":")
        if not module or not name:
            raise ConfigError(f"name {self.name!r} must look like 'module:Class'")
