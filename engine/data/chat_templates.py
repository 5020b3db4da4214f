"""Chat templates for tokenizers that have none (base models), shared by data_prep's ``--chat-template``
and the trainers' ``chat_template`` config keys, and the fingerprint that ties prepared data to the
template that rendered it.

A template is given as a built-in name or a Jinja file (engine/run_config/chat_template.py). The prepare scripts record
the :func:`fingerprint` of the template they rendered with in their summary JSON beside the parquet
files; a trainer refuses data whose summary names another template than its tokenizer's
(:func:`data_template_difference`), since the token counts and length filters were computed with it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING

from engine.run_config.chat_template import BUILT_IN, TemplateError, resolve

if TYPE_CHECKING:  # transformers loads with a tokenizer
    from transformers import PreTrainedTokenizerBase

# The summaries the prepare scripts write beside their files, by file-name prefix, most specific first.
SUMMARY_FILES = {"sft_": ("sft_summary.json",), "prompts_": ("prompts_summary.json", "summary.json")}
SUMMARY_KEY = "chat_template"


def load_tokenizer(
    path: str, chat_template: str, option: str, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer at ``path`` with ``chat_template`` (:func:`resolve`; '': its own); :class:`TemplateError`
    naming ``option`` when it ends up with none (its message does not name ``path``). Loading errors
    (OSError, ValueError) pass through."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if chat_template:
        tokenizer.chat_template = resolve(chat_template, option)
    if not tokenizer.chat_template:
        raise TemplateError(
            "the tokenizer has no chat template, which renders every prompt and response; set "
            f"{option} to a built-in ({', '.join(BUILT_IN)}) or a Jinja file (e.g. the instruct model's of its family)"
        )
    return tokenizer


def fingerprint(template: str) -> str:
    """A short hash of a template's text."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


def summary_record(tokenizer: PreTrainedTokenizerBase, given: str | None) -> dict[str, str | None]:
    """What a prepare script's summary says of the template that rendered its data (``given``: its
    ``--chat-template``, None: the tokenizer's own)."""
    return {"given": given, "sha256": fingerprint(str(tokenizer.chat_template))}


def summary_path(data_path: str) -> str | None:
    """The summary JSON a prepare script wrote beside ``data_path``, or None."""
    name = os.path.basename(data_path)
    names = next((s for prefix, s in SUMMARY_FILES.items() if name.startswith(prefix)), ("summary.json",))
    paths = [os.path.join(os.path.dirname(data_path), s) for s in names]
    return next((p for p in paths if os.path.isfile(p)), None)


def data_template_difference(data_path: str, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """How the template recorded in ``data_path``'s summary differs from ``tokenizer``'s, in words; None
    when they agree or no summary (or one without the record: older data) is beside it."""
    path = summary_path(data_path)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f).get(SUMMARY_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(record, dict) or record.get("sha256") == fingerprint(str(tokenizer.chat_template)):
        return None
    given = record.get("given")
    how = f"--chat-template {given}" if given else "the tokenizer's own template"
    return f"{path} says it was rendered with {how} (sha256 {record.get('sha256')}), not the template this run uses"
