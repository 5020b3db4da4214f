"""A base model's tokenizer without a chat template: --chat-template in data_prep and the trainers'
chat_template key give it one, the same for both, and a trainer refuses data another template rendered."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import run_script, write_sft_config
from transformers import AutoTokenizer

from data_prep import make_tiny_model, prepare_sft
from engine.config import ConfigError, build_config
from engine.data.chat_templates import data_template_difference, fingerprint, summary_path
from engine.run.launch import RunRefused
from engine.run.preflight import check_data_templates, load_tokenizer
from engine.run_config import SFTConfig
from engine.run_config.chat_template import CHATML, resolve


@pytest.fixture(scope="module")
def base_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model as a base model comes: its tokenizer saved without a chat template."""
    base = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(tiny_model_dir, base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    return base


def test_a_base_model_prepares_and_trains_with_a_built_in_template(base_model_dir, synthetic_pairs, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(synthetic_pairs.read_text().splitlines(keepends=True)[:64]))
    argv = ["--input", str(pairs), "--tokenizer", str(base_model_dir), "--out", str(tmp_path / "data")]
    assert prepare_sft.main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: --tokenizer {base_model_dir}: the tokenizer has no chat template" in err
    assert "set --chat-template to a built-in (chatml) or a Jinja file" in err and "Traceback" not in err
    assert prepare_sft.main([*argv, "--chat-template", "chatml"]) == 0
    summary = json.loads((tmp_path / "data" / "sft_summary.json").read_text())
    assert summary["chat_template"] == {"given": "chatml", "sha256": fingerprint(CHATML)}

    # the trainer: refused without its key (naming it), accepted with the same template (a dry run)
    config = write_sft_config(tmp_path / "sft.json", base_model_dir, tmp_path / "data", tmp_path / "run")
    refusal = r"'model.path' \(.*\): the tokenizer has no chat template.*set 'model.chat_template' to a built-in"
    with pytest.raises(RunRefused, match=refusal):
        load_tokenizer(str(base_model_dir), "model.path", template_key="model.chat_template")
    result = run_script("train_sft.py", config, "--dry-run", "--model.chat_template", "chatml")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dry run of train_sft.py" in result.stdout and not (tmp_path / "run").exists()
    # the tokenizer the trainer saves with its model (engine/models/deepspeed_glue.save_hf_model) keeps it
    load_tokenizer(str(base_model_dir), "model.path", chat_template="chatml").save_pretrained(tmp_path / "saved")
    assert load_tokenizer(str(tmp_path / "saved"), "actor.path").chat_template == CHATML


def test_data_rendered_with_another_template_is_refused_naming_key_and_file(tiny_model_dir, tmp_path):
    spaced = tmp_path / "spaced.jinja"
    spaced.write_text(make_tiny_model.SPACED_CHAT_TEMPLATE)
    data = tmp_path / "data"
    data.mkdir()
    (data / "summary.json").write_text(json.dumps({"chat_template": {"given": None, "sha256": fingerprint(CHATML)}}))
    chatml = load_tokenizer(str(tiny_model_dir), "model.path")
    other = load_tokenizer(str(tiny_model_dir), "model.path", chat_template=str(spaced))
    assert other.chat_template == spaced.read_text() and chatml.chat_template == CHATML
    # prompts_* files are prepare_prompts' (prompts_summary.json) or prepare_preferences' (summary.json)
    assert summary_path(str(data / "prompts_train.parquet")) == str(data / "summary.json")
    assert summary_path(str(data / "sft_train.parquet")) is None  # no sft_summary.json: nothing to check
    check_data_templates(chatml, {"data.train": str(data / "train.parquet"), "data.validation": ""}, "k")
    with pytest.raises(RunRefused, match=rf"'data.validation' \({data}/validation.parquet\): {data}/summary.json says"):
        check_data_templates(other, {"data.validation": str(data / "validation.parquet")}, "model.chat_template")
    (data / "summary.json").write_text(json.dumps({"read": 3}))  # prepared before summaries recorded templates
    assert data_template_difference(str(data / "train.parquet"), other) is None


def test_a_template_is_a_built_in_or_a_file_else_refused_by_name(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert resolve("chatml", "--chat-template") == CHATML
    assert resolve(str(tmp_path / "t.jinja"), "--chat-template") == "{{ messages[0]['content'] }}"
    data = {"model": {"path": "m", "chat_template": "llama3"}, "data": {"train": "t"}, "deepspeed": {}}
    with pytest.raises(ConfigError, match=r"model: 'chat_template' 'llama3': neither a built-in \(chatml\) nor a"):
        build_config(SFTConfig, data, "sft.json")
    with pytest.raises(SystemExit) as exit:
        prepare_sft.main(["--input", "x.jsonl", "--tokenizer", "m", "--out", "o", "--chat-template", "llama3"])
    assert exit.value.code == 2
