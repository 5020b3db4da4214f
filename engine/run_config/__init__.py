"""The JSON config schema of the launched scripts (see engine/config.py for the loader).

    python -m engine.run_config [--out ds_configs/schema]

writes it as JSON Schema files (``train_sft.schema.json``, ``train_rm.schema.json``,
``train_ppo.schema.json``, ``train_dpo.schema.json``) for editors: a config that starts with
``"$schema": "schema/train_rm.schema.json"`` is validated and completed as it is typed.

The sections the scripts share are in ``common.py``, each script's config in ``sft.py``, ``rm.py``,
``ppo.py`` and ``dpo.py``, the schema export in ``schema.py``; the names the rest of the code
imports are re-exported here.
"""

from engine.run_config.common import LoraSection, resolve_deepspeed_dtype
from engine.run_config.dpo import DPOConfig, DPOSection, PreferenceLossName
from engine.run_config.ppo import AdvantageEstimator, CriticSource, KLEstimator, LossAggregation, PPOConfig
from engine.run_config.rm import RewardModelConfig, RMSection
from engine.run_config.schema import SCRIPT_CONFIGS, schemas
from engine.run_config.sft import SFTConfig

__all__ = [
    "SCRIPT_CONFIGS",
    "AdvantageEstimator",
    "CriticSource",
    "DPOConfig",
    "DPOSection",
    "KLEstimator",
    "LoraSection",
    "LossAggregation",
    "PPOConfig",
    "PreferenceLossName",
    "RMSection",
    "RewardModelConfig",
    "SFTConfig",
    "resolve_deepspeed_dtype",
    "schemas",
]
