"""Parsing one raw preference row into a :class:`PreferencePair`.

Two input shapes are understood:

* **HH-RLHF** rows ``{"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": ...}``: the
  prompt is the dialogue up to and including the last ``"\\n\\nAssistant:"``, turned into chat
  messages; the responses are what follows it.
* **Generic** rows with ``prompt`` (string or message list) and ``chosen``/``rejected``
  (strings, a one-message assistant list, or, as UltraFeedback-binarized has them, the whole
  conversation: the prompt's messages then the assistant's), optional ``margin`` (float) and optional
  ``components`` (``{"helpful": 1, "harmless": -1}``: +1 chosen is better under that
  component, -1 rejected is, 0 no preference). Without ``prompt``, chosen and rejected may be
  whole conversations (message lists) whose shared prefix is the prompt.

Malformed rows raise :class:`InvalidRow` (reason + field). Well-formed rows that should not be
trained on (identical or empty responses, HH rows whose dialogues diverge before the last turn)
raise :class:`DroppedRow`. Both are counted by reason by the caller. Both, and the message
parsers, serve the SFT rows too (data_prep/conversation_rows.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from data_prep.sources import BadJSON

Message = dict[str, str]
ROLES = ("system", "user", "assistant", "tool")
HH_ASSISTANT = "\n\nAssistant:"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


class InvalidRow(ValueError):
    """A row that does not have the expected shape; ``reason`` is a short counting key."""

    def __init__(self, reason: str, field_name: str, detail: str):
        super().__init__(f"field '{field_name}': {detail}")
        self.reason = reason
        self.field_name = field_name


class DroppedRow(Exception):
    """A well-formed row that is not used; ``reason`` is a short counting key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PreferencePair:
    """One preference: prompt messages, the preferred and the other response."""

    prompt: list[Message]
    chosen: str
    rejected: str
    margin: float | None = None
    components: dict[str, int] = field(default_factory=dict)


def parse_preference_row(row: Any) -> PreferencePair:
    """Parse and check one raw row (see the module docstring for the accepted shapes)."""
    if isinstance(row, BadJSON):
        raise InvalidRow("bad_json", "<row>", row.error)
    if not isinstance(row, dict):
        raise InvalidRow("not_object", "<row>", f"expected a JSON object, got {type(row).__name__}")
    for name in ("chosen", "rejected"):
        if name not in row or row[name] is None:
            raise InvalidRow("missing_field", name, "missing")
    if row.get("prompt") is not None:
        prompt = parse_messages(row["prompt"], "prompt", allow_string=True)
        chosen = parse_response(after_prompt(row["chosen"], prompt), "chosen")
        rejected = parse_response(after_prompt(row["rejected"], prompt), "rejected")
    elif isinstance(row["chosen"], str) and isinstance(row["rejected"], str):
        prompt, chosen, rejected = _split_hh(row["chosen"], row["rejected"])
    else:
        prompt, chosen, rejected = _split_conversations(row["chosen"], row["rejected"])
    if prompt[-1]["role"] != "user":
        raise InvalidRow("bad_message", "prompt", f"the last prompt message must be 'user', got {prompt[-1]['role']!r}")
    pair = PreferencePair(
        prompt=prompt,
        chosen=chosen,
        rejected=rejected,
        margin=_parse_margin(row.get("margin")),
        components=_parse_components(row.get("components")),
    )
    if not pair.chosen.strip() or not pair.rejected.strip():
        raise DroppedRow("empty_response")
    if pair.chosen.strip() == pair.rejected.strip():
        raise DroppedRow("identical_responses")
    return pair


def after_prompt(value: Any, prompt: list[Message]) -> Any:
    """A response given as the whole conversation (UltraFeedback-binarized: the prompt's messages, then
    the assistant's) without the prompt's messages; any other value as it is."""
    if isinstance(value, list) and len(value) > len(prompt):
        head = [m for m in value[: len(prompt)] if isinstance(m, dict)]
        if [(m.get("role"), str(m.get("content", "")).strip()) for m in head] == [
            (m["role"], m["content"].strip()) for m in prompt
        ]:
            return value[len(prompt) :]
    return value


def split_hh_dialogue(text: str, field_name: str) -> list[Message]:
    """``"\\n\\nHuman: a\\n\\nAssistant: b"`` -> ``[{"role": "user", "content": "a"}, ...]``."""
    parts = _HH_TURN.split(text)
    if parts[0].strip():
        raise InvalidRow("bad_dialogue", field_name, "text before the first '\\n\\nHuman:' turn")
    roles, contents = parts[1::2], parts[2::2]
    if not roles:
        raise InvalidRow("bad_dialogue", field_name, "no '\\n\\nHuman:' / '\\n\\nAssistant:' turns")
    return [
        {"role": "user" if role == "Human" else "assistant", "content": content.strip()}
        for role, content in zip(roles, contents)
    ]


def _split_hh(chosen: str, rejected: str) -> tuple[list[Message], str, str]:
    cut_c, cut_r = chosen.rfind(HH_ASSISTANT), rejected.rfind(HH_ASSISTANT)
    for cut, name in ((cut_c, "chosen"), (cut_r, "rejected")):
        if cut < 0:
            raise InvalidRow("bad_dialogue", name, "no '\\n\\nAssistant:' turn in an HH-style row")
    prefix = chosen[: cut_c + len(HH_ASSISTANT)]
    if prefix != rejected[: cut_r + len(HH_ASSISTANT)]:
        # Real HH rows do this when one response carries extra turns inside it.
        raise DroppedRow("turn_mismatch")
    prompt = split_hh_dialogue(chosen[:cut_c], "chosen")
    return prompt, chosen[cut_c + len(HH_ASSISTANT) :].strip(), rejected[cut_r + len(HH_ASSISTANT) :].strip()


def _split_conversations(chosen: Any, rejected: Any) -> tuple[list[Message], str, str]:
    chosen_msgs = parse_messages(chosen, "chosen", allow_string=False)
    rejected_msgs = parse_messages(rejected, "rejected", allow_string=False)
    shared = 0
    while shared < min(len(chosen_msgs), len(rejected_msgs)) - 1 and chosen_msgs[shared] == rejected_msgs[shared]:
        shared += 1
    if shared == 0:
        raise InvalidRow("missing_field", "prompt", "no 'prompt' and chosen/rejected share no prompt messages")
    if len(chosen_msgs) != shared + 1 or len(rejected_msgs) != shared + 1:
        raise DroppedRow("turn_mismatch")
    return (
        chosen_msgs[:shared],
        parse_response(chosen_msgs[-1:], "chosen"),
        parse_response(rejected_msgs[-1:], "rejected"),
    )


def parse_messages(value: Any, field_name: str, allow_string: bool) -> list[Message]:
    if allow_string and isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        kind = "a string or a non-empty message list" if allow_string else "a non-empty message list"
        raise InvalidRow("wrong_type", field_name, f"expected {kind}, got {type(value).__name__}")
    messages = []
    for i, message in enumerate(value):
        where = f"{field_name}[{i}]"
        if not isinstance(message, dict):
            raise InvalidRow(
                "bad_message", where, f"expected an object with role/content, got {type(message).__name__}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidRow("bad_message", f"{where}.role", f"expected one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise InvalidRow("bad_message", f"{where}.content", f"expected a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    return messages


def parse_response(value: Any, field_name: str) -> str:
    if isinstance(value, str):
        return value
    messages = parse_messages(value, field_name, allow_string=False)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise InvalidRow("bad_message", field_name, "a response list must be exactly one 'assistant' message")
    return messages[0]["content"]


def _parse_margin(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRow("bad_margin", "margin", f"expected a finite number, got {value!r}")
    return float(value)


def _parse_components(value: Any) -> dict[str, int]:
    if value is None:
        return {}
    if isinstance(value, list):  # a parquet map column reads back as [(key, value), ...]
        try:
            value = dict(value)
        except (TypeError, ValueError):
            raise InvalidRow("bad_components", "components", "expected an object of name -> -1/0/1") from None
    if not isinstance(value, dict):
        raise InvalidRow("bad_components", "components", f"expected an object, got {type(value).__name__}")
    components = {}
    for name, preference in value.items():
        if isinstance(preference, bool) or preference not in (-1, 0, 1):
            raise InvalidRow(
                "bad_components",
                f"components.{name}",
                f"expected -1, 0 or 1 (which response is better), got {preference!r}",
            )
        components[str(name)] = int(preference)
    return components
