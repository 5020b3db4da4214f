"""What an export reads: a resumable checkpoint (engine/run/checkpoint.py) of a run, the run's resolved
config (its ``config.json``) and, from that config, the model a checkpointed engine holds.

A checkpoint is named by its own directory (``RUN/checkpoints/stepNNNNNNNN``), by the run's
``checkpoints/`` or by the run directory (then the one ``checkpoints/latest`` names, as ``--resume``
takes it). Each engine's files are in the checkpoint under its name: ``model`` (SFT, RM, DPO),
``actor`` and ``critic`` (PPO).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, NamedTuple

from engine.config import Config, ConfigError, build_config
from engine.run.checkpoint import complete_checkpoints, describe_checkpoints, latest_checkpoint
from engine.run.launch import RunRefused
from engine.run_config import DPOConfig, LoraSection, PPOConfig, RewardModelConfig, SFTConfig

STEP_DIR = re.compile(r"^step\d{8}$")
# A run config's own section -> its script's config class (SFT's has none of them).
SCRIPTS_BY_SECTION: dict[str, type[Config]] = {"actor": PPOConfig, "dpo": DPOConfig, "rm": RewardModelConfig}


class Checkpoint(NamedTuple):
    path: str  # RUN/checkpoints/stepNNNNNNNN
    run_dir: str
    step: int


class ExportedModel(NamedTuple):
    """The model an engine of a checkpoint holds, as its run built it."""

    engine: str  # the engine's name in the checkpoint
    path: str  # the model its weights started from (base weights, tokenizer, architecture)
    key: str  # the run config's key naming ``path``
    value_head: bool  # a value model (reward model, critic), else a causal LM
    components: list[str] | None  # a value model's heads (None: those saved at ``path``)
    lora: LoraSection  # rank 0: every weight is in the checkpoint
    bf16: bool  # the dtype of the run's weights, and of the export
    trust_remote_code: bool
    chat_template: str  # the run's chat template ('': the tokenizer's own)


def find_checkpoint(path: str) -> Checkpoint:
    """The complete checkpoint ``path`` names (see the module docstring); :class:`RunRefused` for a
    missing path, a damaged checkpoint or a run without one."""
    path = os.path.normpath(path)
    if STEP_DIR.match(os.path.basename(path)):
        root = os.path.dirname(path)
        if not os.path.isdir(path):
            raise RunRefused("checkpoint", f"--checkpoint {path}: no such checkpoint ({describe_checkpoints(root)})")
        if path not in complete_checkpoints(root):
            raise RunRefused(
                "checkpoint",
                f"--checkpoint {path}: incomplete or damaged (its files differ from its MANIFEST.json, or it has "
                f"none: an interrupted save or copy); complete ones: {_names(complete_checkpoints(root))}",
            )
    else:
        root = path if os.path.basename(path) == "checkpoints" else os.path.join(path, "checkpoints")
        if not os.path.isdir(root):
            raise RunRefused(
                "checkpoint", f"--checkpoint {path}: not a run directory, its checkpoints/ or a checkpoint in it"
            )
        found = latest_checkpoint(root)
        if found is None:
            raise RunRefused("checkpoint", f"--checkpoint {path}: {describe_checkpoints(root)}")
        path = found
    return Checkpoint(path, os.path.dirname(os.path.dirname(path)), int(os.path.basename(path)[4:]))


def _names(paths: list[str]) -> str:
    return ", ".join(os.path.basename(p) for p in paths) or "none"


def run_config(checkpoint: Checkpoint) -> Config:
    """The run's resolved config (``config.json`` of its directory), as its script's config class."""
    file = os.path.join(checkpoint.run_dir, "config.json")
    try:
        with open(file) as f:
            data: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as e:
        raise RunRefused("checkpoint", f"{file}: the run's config cannot be read ({e}); the export needs it") from None
    script = next((cls for key, cls in SCRIPTS_BY_SECTION.items() if key in data), SFTConfig)
    try:
        return build_config(script, data, source=file)
    except ConfigError as e:
        raise RunRefused("checkpoint", f"the run's config does not load: {e}") from None


def exported_model(config: Config, engine: str | None) -> ExportedModel:
    """The model of ``engine`` (``model``; PPO: ``actor`` or ``critic``; None: ``actor`` or ``model``) in a
    run of ``config``."""
    if isinstance(config, PPOConfig):
        engine = engine or "actor"
        actor = config.actor
        bf16, trust_remote_code = bool(actor.bf16), actor.trust_remote_code
        if engine == "actor":
            return ExportedModel(
                engine=engine,
                path=actor.path,
                key="actor.path",
                value_head=False,
                components=None,
                lora=actor.lora,
                bf16=bf16,
                trust_remote_code=trust_remote_code,
                chat_template=actor.chat_template,
            )
        if engine == "critic" and config.has_critic():
            source = config.critic_source()
            key = "actor.path" if source.path == actor.path else "reward_model.path"
            return ExportedModel(
                engine=engine,
                path=source.path,
                key=key,
                value_head=True,
                components=source.components,
                lora=config.critic.lora,
                bf16=bf16,
                trust_remote_code=trust_remote_code,
                chat_template=actor.chat_template if source.path == actor.path else "",
            )
        engines = "'actor' and 'critic'" if config.has_critic() else "'actor' only (a critic-free advantage estimator)"
        raise RunRefused("checkpoint", f"--engine {engine}: this PPO run's checkpoints hold {engines}")
    engine = engine or "model"
    if engine != "model":
        raise RunRefused("checkpoint", f"--engine {engine}: this run's checkpoints hold one engine, 'model'")
    model = config.model  # type: ignore[attr-defined]  # SFT, RM and DPO configs each have one
    rm = config.rm if isinstance(config, RewardModelConfig) else None
    return ExportedModel(
        engine=engine,
        path=model.path,
        key="model.path",
        value_head=rm is not None,
        components=list(rm.components) if rm else None,
        lora=model.lora if isinstance(config, DPOConfig) else LoraSection(),
        bf16=bool(model.bf16),
        trust_remote_code=model.trust_remote_code,
        chat_template=model.chat_template,
    )
