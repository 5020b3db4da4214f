"""The skeleton the supervised recipes (train/train_sft.py, train_rm.py, train_dpo.py) compose: what
they do alike, in the order they do it.

    sup = SupervisedRun(cfg, run_args, rank, world)           # DeepSpeed config, tokenizer, weights check
    train = ...load with sup.tokenizer...; a dry run stops here
    sup.open(train, per_step, {...})                          # schedule, output-directory checks (no model yet)
    engine = sup.start(desc="sft")                            # model -> DeepSpeed engine -> start or resume
    sup.announce("train_sft: ...")
    ended = sup.train("sft", step, evaluate)                  # the epoch loop
    if ended is not None:                                     # a stop signal, a checkpoint error, a guard
        return ended
    final = sup.evaluate_final(evaluate)
    return sup.export(summary)                                # HF model, the run's last line, the report

The recipe keeps what is its own: the data, the identity keys beyond the shared ones, the step and
the evaluation, and the summary.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from engine.config import Config, config_to_dict
from engine.data.batching import epoch_batch, epoch_schedule
from engine.models.deepspeed_glue import (
    describe_engine,
    initialize_training_engine,
    load_partitioned,
    save_hf_model,
    training_ds_config,
)
from engine.models.loading import load_causal_lm, load_value_model
from engine.models.lora import add_adapters
from engine.run.checkpoint import content_fingerprint
from engine.run.guards import NonFiniteGuard
from engine.run.launch import RunArgs
from engine.run.lifecycle import RunEnded, RunLifecycle
from engine.run.preflight import check_data_templates, check_weights, load_tokenizer
from engine.run.step_metrics import optimizer_step_metrics
from engine.run_config.common import (
    CheckpointSection,
    EpochsSection,
    GuardsSection,
    LoggingSection,
    LoraSection,
    ModelSection,
    OptimSection,
)

EXPORT_DIR = "model"  # the trained model in HF format, under logging.output_dir

Metrics = dict[str, float]
# (the step's items, their indices in the train data, the 1-based step number) -> the step's loss terms
TrainStep = Callable[[list[Any], list[int], int], Metrics]


class TrainData(Protocol):
    """The data section: the train data's file and the validation data's ('': none) at least."""

    @property
    def train(self) -> str: ...
    @property
    def validation(self) -> str: ...


class SupervisedConfig(Protocol):
    """The sections every supervised recipe's config has (SFTConfig, RewardModelConfig, DPOConfig: each a
    :class:`Config`, which the protocol cannot say, hence the casts for :func:`config_to_dict`)."""

    @property
    def model(self) -> ModelSection: ...
    @property
    def data(self) -> TrainData: ...
    @property
    def deepspeed(self) -> dict[str, Any]: ...
    @property
    def train(self) -> EpochsSection: ...
    @property
    def optim(self) -> OptimSection: ...
    @property
    def checkpoint(self) -> CheckpointSection: ...
    @property
    def guards(self) -> GuardsSection: ...
    @property
    def logging(self) -> LoggingSection: ...


class Example(Protocol):
    """A train item: a conversation or a preference pair."""

    @property
    def num_tokens(self) -> int: ...


def training_engine(
    model: ModelSection,
    ds_config: dict[str, Any],
    optim: OptimSection,
    total_steps: int,
    *,
    components: Sequence[str] | None = None,
    lora: LoraSection | None = None,
) -> tuple[Any, Any]:
    """The ``model`` section's model in a DeepSpeed engine with AdamW and its schedule over ``total_steps``:
    a causal LM, or with ``components`` a value model with one head output per reward component; LoRA
    adapters on it when ``lora`` has a rank; gradient checkpointing as configured. Returns ``(engine,
    keep_alive)`` (hold ``keep_alive`` as long as the engine: :func:`load_partitioned`)."""
    dtype = torch.bfloat16 if model.bf16 else torch.float32

    def load() -> PreTrainedModel:
        if components is None:
            return load_causal_lm(
                model.path,
                dtype=dtype,
                attn_implementation=model.attn_implementation,
                trust_remote_code=model.trust_remote_code,
            )
        return load_value_model(
            model.path,
            components,
            dtype=dtype,
            attn_implementation=model.attn_implementation,
            trust_remote_code=model.trust_remote_code,
        )

    loaded: PreTrainedModel | PeftModel
    loaded, keep_alive = load_partitioned(load, ds_config)
    if lora is not None and lora.rank:
        loaded = add_adapters(loaded, lora, causal_lm=components is None)
    if model.gradient_checkpointing:
        loaded.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return initialize_training_engine(loaded, ds_config, **optim.schedule(total_steps)), keep_alive


class SupervisedRun:
    """One supervised run: the set-up, the lifecycle (engine/run/lifecycle.py), the engine and the epoch loop.

    ``components``: the model is a value model with one head output per reward component (a reward
    model); None: a causal LM. ``lora``: adapters on it, when its rank is set.
    """

    def __init__(
        self,
        cfg: SupervisedConfig,
        run_args: RunArgs,
        rank: int,
        world: int,
        *,
        components: Sequence[str] | None = None,
        lora: LoraSection | None = None,
    ):
        self.cfg, self.run_args, self.rank, self.world = cfg, run_args, rank, world
        self.components, self.lora = components, lora
        self.ds_config = training_ds_config(cfg.deepspeed, bool(cfg.model.bf16))
        self.tokenizer = load_tokenizer(
            cfg.model.path, "model.path", cfg.model.trust_remote_code, cfg.model.chat_template, "model.chat_template"
        )
        data = {"data.train": cfg.data.train, "data.validation": cfg.data.validation}
        check_data_templates(self.tokenizer, data, "model.chat_template")
        check_weights(
            cfg.model.path,
            "model.path",
            value_head=components is not None,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        self.last_metrics: Metrics = {}  # of the last step this process ran

    def open(self, train: Sequence[Example], per_step: int, identity: dict[str, Any]) -> RunLifecycle:
        """The schedule (``per_step`` items of ``train`` per optimizer step) and the run in the output
        directory, refused there before any model loads. What a checkpoint must share with it: the model,
        the train data, ``identity``, the seed, the world size and the LoRA settings."""
        cfg = self.cfg
        self.examples, self.per_step = train, per_step
        self.steps_per_epoch, self.total_steps = epoch_schedule(
            len(train), per_step, cfg.train.epochs, cfg.train.max_steps
        )
        self.run = RunLifecycle(
            output_dir=cfg.logging.output_dir,
            run_args=self.run_args,
            export_dir=EXPORT_DIR,
            checkpoint=cfg.checkpoint,
            identity={"model": cfg.model.path, "data.train": content_fingerprint(cfg.data.train)}
            | identity
            | {"seed": cfg.train.seed, "world_size": self.world}
            | ({"lora": vars(self.lora)} if self.lora is not None and self.lora.rank else {}),
        )
        self.nonfinite = NonFiniteGuard(cfg.guards.max_nonfinite_in_a_row)
        self.run.track("nonfinite", self.nonfinite, rolls_back=False)
        return self.run

    def start(self, desc: str) -> Any:
        """The model in a DeepSpeed engine (:func:`training_engine`), then start or resume the run
        (``desc``: the progress bar's label). Track the recipe's own state on :attr:`run` before.
        Returns the engine."""
        cfg = self.cfg
        self.engine, self.keep_alive = training_engine(
            cfg.model, self.ds_config, cfg.optim, self.total_steps, components=self.components, lora=self.lora
        )
        self.run.start(
            engines={"model": self.engine},
            lr_engine=self.engine,
            export_engine=self.engine,
            config=config_to_dict(cast(Config, cfg)),
            total_steps=self.total_steps,
            logging=cfg.logging,
            desc=desc,
        )
        return self.engine

    def announce(self, head: str) -> None:
        """Rank 0 prints ``head``, the steps, the ranks, the engine in effect and where the run resumed."""
        if self.rank == 0:
            run = self.run
            print(
                f"{head}, {self.total_steps} steps, {self.world} rank(s), {describe_engine(self.engine)}"
                + (f", resumed at step {run.step} from {run.resume_from}" if run.resume_from else "")
            )

    def train(self, kind: str, step: TrainStep, evaluate: Callable[[], Metrics] | None) -> int | None:
        """The epoch loop from the run's step to the last: ``step``, the guards, the metrics (the step's
        under ``kind``/), ``evaluate`` every ``train.eval_every_steps`` (None: no held-out data) and the
        checkpoints. None when every step ran; the exit code when the run ended before (:class:`RunEnded`)."""
        run, engine, schedule = self.run, self.engine, self.cfg.train
        try:
            while run.step < self.total_steps:
                indices, epochs = epoch_batch(
                    run.step, len(self.examples), self.per_step, self.steps_per_epoch, schedule.seed
                )
                batch = [self.examples[i] for i in indices]
                start = time.perf_counter()
                engine.train()
                step_metrics = step(batch, indices, run.step + 1)
                seconds = time.perf_counter() - start
                run.step += 1
                run.check_step(self.nonfinite, run.step, engine)
                metrics = {f"{kind}/{k}": v for k, v in step_metrics.items()} | optimizer_step_metrics(
                    kind, engine, epochs, seconds, sum(e.num_tokens for e in batch), self.nonfinite.skipped
                )
                every = schedule.eval_every_steps
                if evaluate is not None and every and run.step % every == 0 and run.step < self.total_steps:
                    engine.eval()
                    metrics |= {f"eval/{k}": v for k, v in evaluate().items()}
                run.log(metrics, **progress(kind, metrics))
                self.last_metrics = metrics
                run.end_of_step()
        except RunEnded as end:
            return run.finish(end.code, str(end))
        return None

    def evaluate_final(self, evaluate: Callable[[], Metrics]) -> Metrics:
        """The last held-out evaluation, logged under eval/ at the last step."""
        self.engine.eval()
        final = evaluate()
        self.run.logger.log(self.run.step, {f"eval/{k}": v for k, v in final.items()})
        return final

    def export(self, summary: str, extra_json: dict[str, dict] | None = None) -> int:
        """Save the model in HF format with ``extra_json`` and the run's config, end the run with
        ``summary`` and where the model is; returns 0."""
        out = self.cfg.logging.output_dir
        save_hf_model(
            self.engine,
            self.tokenizer,
            os.path.join(out, EXPORT_DIR),
            (extra_json or {}) | {"train_config.json": config_to_dict(cast(Config, self.cfg))},
        )
        self.keep_alive = None  # from_pretrained is no ZeRO-3 collective any more
        return self.run.finish(0, f"{summary}; model saved to {out}/{EXPORT_DIR}")


def progress(kind: str, metrics: Metrics) -> dict[str, str]:
    """The progress bar's postfix: the loss, the accuracy of a preference loss, the throughput."""
    shown = {"loss": f"{metrics[f'{kind}/loss']:.3f}"}
    if f"{kind}/acc" in metrics:
        shown["acc"] = f"{metrics[f'{kind}/acc']:.2f}"
    return shown | {"tok_s": f"{metrics['timing/tokens_per_s']:.0f}"}
