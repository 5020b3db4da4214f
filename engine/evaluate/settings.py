"""The settings of train/evaluate.py: typed and checked as the run configs are (engine/config.py), given
as command-line flags (``--max-new-tokens 512`` sets ``max_new_tokens``), and the rewards section they
make (a verifier of PPO's ``rewards``, or a PPO config's whole section)."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Sequence
from typing import Any, Literal

from engine.config import Config, ConfigError, build_config, load_config, option, required
from engine.run_config import PPOConfig
from engine.run_config.common import MAX_SEED
from engine.run_config.rewards import CodeReward, FormatReward, MathReward, RewardsSection


class EvaluationSettings(Config):
    model: str = required("HF model directory to evaluate (an SFT model/, a PPO actor/, an export)")
    prompts: str = required("prompts parquet (data_prep/prepare_prompts.py or prepare_preferences.py)")
    out: str = required("directory for summary.json and samples.jsonl")
    baseline: str = option(
        "",
        "a second model sampled on the same prompts with the same seed ('': none); with a reward model, the win "
        "rate of --model over it",
    )
    reward_model: str = option(
        "", "reward model directory (train_rm.py's model/): each response's score, its heads weighted, unnormalised"
    )
    verifier: Literal["", "math", "code", "format"] = option(
        "", "a verifier of PPO's rewards section, with its defaults: correct when it gives 1 ('': none)"
    )
    field: str = option("", "the prompts column the verifier reads ('': its default, answer for math, tests for code)")
    pattern: str = option("", "the format verifier's regular expression (math: the final answer's, '': its default)")
    rewards_from: str = option(
        "", "a PPO config whose rewards section scores the responses, all its components (correct: every verifier 1)"
    )
    samples: int = option(1, "samples per prompt, n: pass@k is reported for k = 1, 2, 4, ... n", ge=1)
    temperature: float = option(1.0, "sampling temperature (0: greedy, with --samples 1)", ge=0)
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens with this much probability", gt=0, le=1)
    max_new_tokens: int = option(1024, "response length limit in tokens (reasoning needs hundreds)", ge=1)
    seed: int = option(0, "the draw's seed (the same for --model and --baseline)", ge=0, le=MAX_SEED)
    dtype: Literal["float32", "bfloat16"] = option("float32", "vLLM's weights (float32: greedy equals HF's exactly)")
    kv_cache_mb: int = option(256, "vLLM's KV cache on a CPU (on a GPU it takes 85% of the free memory)", ge=16)
    max_tokens_per_micro_batch: int = option(4096, "reward model: token budget of one packed forward", ge=2)
    overwrite: bool = option(False, "replace summary.json and samples.jsonl in --out")

    def check(self) -> None:
        if self.verifier and self.rewards_from:
            raise ConfigError("--verifier and --rewards-from both give the rewards: pass one")
        if self.temperature == 0 and self.samples > 1:
            raise ConfigError(f"--temperature 0 is greedy: its {self.samples} samples would be one; use --samples 1")
        if self.verifier == "format" and not self.pattern:
            raise ConfigError("--verifier format needs --pattern (the regular expression a response must contain)")

    def rewards(self) -> tuple[RewardsSection | None, dict[str, str]]:
        """The rewards section that scores the responses, and the prompt columns it reads -> the flag
        or config key that makes it read each (None, {}: no verifier)."""
        if self.rewards_from:
            section = load_config(PPOConfig, self.rewards_from).rewards
            return section, section.fields(prefix=f"{self.rewards_from}: rewards")
        column = lambda verifier: self.field or verifier.model_fields["field"].default  # '': the verifier's own
        if self.verifier == "math":
            section = RewardsSection(math=MathReward(field=column(MathReward), pattern=self.pattern))
        elif self.verifier == "code":
            section = RewardsSection(code=CodeReward(field=column(CodeReward)))
        elif self.verifier == "format":
            section = RewardsSection(format=FormatReward(pattern=self.pattern))
        else:
            return None, {}
        return section, dict.fromkeys(section.fields(), f"--verifier {self.verifier}")


def parse_settings(argv: Sequence[str] | None, prog: str, description: str) -> EvaluationSettings:
    """The settings from the command line: one flag per field, its help the field's description
    (:class:`ConfigError` naming the flag for a bad value)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for name, field in EvaluationSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        about = (field.description or "").replace("%", "%%")  # argparse formats help with %
        if field.annotation is bool:
            parser.add_argument(flag, action="store_true", help=about)
            continue
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else None
        kind: Any = str if choices else field.annotation
        default = "(required)" if field.is_required() else f"(default {field.default!r})"
        parser.add_argument(flag, type=kind, choices=choices, required=field.is_required(), help=f"{about} {default}")
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    return build_config(EvaluationSettings, given, source="command line")
