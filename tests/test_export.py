"""train/export.py on the suite's real runs: a mid-run ZeRO-3 checkpoint of the SFT run becomes an HF
model directory that transformers and vLLM load with that checkpoint's weights (its validation loss
is the one the run logged at that step; vLLM's greedy output is HF's); the reward model's becomes a
value model with its heads; a LoRA checkpoint (ZeRO-2, adapters only) exports to exactly what the
trainers write at the end; damaged checkpoints, an existing output and a missing engine are refused
by name."""

from __future__ import annotations

import json
import os
import runpy
import shutil

import pytest
import torch
from helpers import REPO, SFT_EVERY, free_port, metric_series
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from engine.config import build_config, config_to_dict
from engine.data.chat import prompt_ids
from engine.data.conversations import load_conversations
from engine.models.deepspeed_glue import initialize_training_engine, save_hf_model, training_ds_config
from engine.models.loading import load_causal_lm
from engine.models.lora import add_adapters
from engine.rewards.exact_match import greedy_responses
from engine.rollout.sampler import SamplingSettings
from engine.run.checkpoint import save_checkpoint
from engine.run.launch import RunRefused
from engine.run_config import DPOConfig
from engine.sft.causal_lm import evaluate_conversations

PROMPTS = ["Tell me about the garden in Alder.", "What do you think of the river in Cobton?", "Hello"]


def export(*argv: str) -> int:
    """train/export.py's main in this process (train/ is no package: the script is run by path)."""
    return runpy.run_path(str(REPO / "train" / "export.py"))["main"](list(argv))


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_a_mid_run_checkpoint_exports_to_a_model_transformers_and_vllm_load(
    process_group, sft_run, sft_data, rm_run, tmp_path, monkeypatch, capsys
):
    root, _ = sft_run
    run = root / "run"
    step = 2 * SFT_EVERY  # the last checkpoint; the run went on to its final model after it
    checkpoint = run / "checkpoints" / f"step{step:08d}"
    out = tmp_path / "sft_step"
    assert export("--checkpoint", str(run), "--out", str(out)) == 0  # the run directory: its latest checkpoint
    assert f"(step {step}) to {out}" in capsys.readouterr().out
    provenance = json.loads((out / "exported_from.json").read_text())
    assert provenance == {"checkpoint": str(checkpoint), "step": step, "engine": "model"}
    assert json.loads((out / "train_config.json").read_text()) == json.loads((run / "config.json").read_text())

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    exported, final = weights(model), weights(AutoModelForCausalLM.from_pretrained(run / "model"))
    base = weights(AutoModelForCausalLM.from_pretrained(json.loads((run / "config.json").read_text())["model"]["path"]))
    assert exported.keys() == final.keys() == base.keys()
    assert all(t.dtype == torch.float32 for t in exported.values())
    assert not any(torch.equal(exported[n], final[n]) for n in final if n.endswith("q_proj.weight"))  # trained on
    assert not any(torch.equal(exported[n], base[n]) for n in base if n.endswith("q_proj.weight"))
    # The checkpoint's weights, read by an oracle of the run's own: the validation loss it logged at that step.
    tokenizer = AutoTokenizer.from_pretrained(out)
    validation = load_conversations(str(sft_data / "sft_validation.parquet"), tokenizer)
    loss = evaluate_conversations(model, validation, 1024, tokenizer.pad_token_id)["loss"]
    assert loss == pytest.approx(metric_series(run, "eval/loss")[step], rel=1e-5, abs=1e-6)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(run / "model").get_vocab()
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(run / "model").chat_template

    # vLLM loads it and its greedy responses are HF's (fp32).
    from engine.rollout.vllm_sampler import VLLMSampler

    # The rendezvous of an in-process group; monkeypatch restores them, so that no later launch inherits
    # this process's port (join_world would set MASTER_PORT for good, and its store keeps the port bound).
    rendezvous = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for name, value in (rendezvous | {"MASTER_PORT": str(free_port())}).items():
        monkeypatch.setenv(name, value)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    sampler = VLLMSampler(str(out), 0, "float32", 256, tokenizer.eos_token_id, 16 << 20)
    try:
        groups = sampler.generate([prompt_ids(tokenizer, m) for m in messages], SamplingSettings(1, 0.0, 1.0, 16), 0)
    finally:
        sampler.close()
    vllm_texts = [tokenizer.decode(g[0].response_ids, skip_special_tokens=True) for g in groups]
    assert vllm_texts == greedy_responses(model, tokenizer, messages, max_new_tokens=16)
    assert all(vllm_texts)

    # The reward model's last checkpoint: a value model with the run's heads; no reward statistics yet.
    rm_root, _ = rm_run
    rm_out = tmp_path / "rm_step"
    assert export("--checkpoint", str(rm_root / "run" / "checkpoints"), "--out", str(rm_out)) == 0
    assert "no reward_stats.json" in capsys.readouterr().out
    rm = AutoModelForTokenClassification.from_pretrained(rm_out)
    assert [rm.config.id2label[i] for i in range(2)] == ["helpful", "harmless"]
    assert not (rm_out / "reward_stats.json").exists()
    rm_final = weights(AutoModelForTokenClassification.from_pretrained(rm_root / "run" / "model"))
    assert rm_final.keys() == weights(rm).keys() and not torch.equal(rm.score.weight, rm_final["score.weight"])

    # Refusals, by name, before anything is written.
    with pytest.raises(RunRefused, match=r"--out .*sft_step exists: pass --overwrite"):
        export("--checkpoint", str(run), "--out", str(out))
    with pytest.raises(RunRefused, match=r"--engine critic: this run's checkpoints hold one engine, 'model'"):
        export("--checkpoint", str(run), "--out", str(tmp_path / "critic"), "--engine", "critic")
    with pytest.raises(RunRefused, match=r"not a run directory"):
        export("--checkpoint", str(tmp_path), "--out", str(tmp_path / "x"))
    damaged = tmp_path / "copy" / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, damaged)
    shutil.copy(run / "config.json", tmp_path / "copy" / "config.json")
    shard = damaged / "model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.truncate(shard, shard.stat().st_size // 2)  # an interrupted copy
    with pytest.raises(RunRefused, match=rf"{damaged}: incomplete or damaged .*MANIFEST.json"):
        export("--checkpoint", str(damaged), "--out", str(tmp_path / "y"))
    (damaged.parent / "latest").write_text(damaged.name)
    with pytest.raises(RunRefused, match=rf"1 checkpoint\(s\) in {damaged.parent}, all damaged"):
        export("--checkpoint", str(tmp_path / "copy"), "--out", str(tmp_path / "y"))
    assert not (tmp_path / "y").exists() and not (tmp_path / "critic").exists()


def test_a_lora_checkpoint_exports_as_the_trainer_saves_its_final_model(deepspeed_ready, tiny_model_dir, tmp_path):
    """A LoRA run's ZeRO-2 checkpoint (adapters only) exports to what the trainers write at the end from
    the same engine (engine/models/deepspeed_glue.save_hf_model): the merged model and adapter/."""
    dpo = {
        "model": {"path": str(tiny_model_dir), "lora": {"rank": 4, "alpha": 8.0}},
        "deepspeed": "tiny_cpu_zero2.json",
    }
    config = build_config(DPOConfig, dpo | {"data": {"train": "t.parquet", "validation": "v.parquet"}}, "dpo.json")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config_to_dict(config)))
    torch.manual_seed(0)
    model = add_adapters(load_causal_lm(str(tiny_model_dir)), config.model.lora, causal_lm=True)
    schedule = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, lr_scheduler="constant", warmup_steps=0)
    engine = initialize_training_engine(model, training_ds_config(config.deepspeed, False), total_steps=9, **schedule)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    for _ in range(3):  # the adapters' B leave zero: the merged weights differ from the base
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    save_checkpoint(str(run / "checkpoints"), 3, {"model": engine}, {"run_identity": {}}, keep_last=2)
    save_hf_model(engine, AutoTokenizer.from_pretrained(tiny_model_dir), str(tmp_path / "final"))

    assert export("--checkpoint", str(run), "--out", str(tmp_path / "exported")) == 0
    exported, final = (load_file(tmp_path / d / "model.safetensors") for d in ("exported", "final"))
    base = load_file(tiny_model_dir / "model.safetensors")
    assert exported.keys() == final.keys() == base.keys()  # the base model's names: no base_layer, no lora_
    assert all(torch.equal(exported[n], final[n]) for n in final)
    assert not torch.equal(
        exported["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    adapters = [load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("exported", "final")]
    assert adapters[0].keys() == adapters[1].keys() and all(
        torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[1]
    )
    peft = PeftModel.from_pretrained(load_causal_lm(str(tiny_model_dir)), str(tmp_path / "exported" / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-5, rtol=0)
