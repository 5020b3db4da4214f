"""Parsing one raw row into a conversation to fine-tune on (a message list ending with the assistant).

Accepted shapes:

* ``{"messages": [...]}``: a whole conversation (OpenAI / TRL style); every assistant turn is trained.
* ``{"prompt": str or messages, "response": str or one assistant message}`` (``completion`` also
  accepted for ``response``).
* Preference rows: generic ``{"prompt", "chosen", ...}`` (prompt + chosen response), HH-RLHF
  ``{"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ..."}`` (the chosen dialogue, every assistant turn),
  or ``chosen`` as a message list (the chosen conversation).

Malformed rows raise :class:`InvalidRow`; conversations with an empty assistant turn raise
:class:`DroppedRow`.
"""

from __future__ import annotations

from typing import Any

from data_prep.preference_rows import DroppedRow, InvalidRow, Message, parse_messages, parse_response, split_hh_dialogue
from data_prep.sources import BadJSON


def parse_conversation_row(row: Any) -> list[Message]:
    """Parse and check one raw row (see the module docstring for the accepted shapes)."""
    if isinstance(row, BadJSON):
        raise InvalidRow("bad_json", "<row>", row.error)
    if not isinstance(row, dict):
        raise InvalidRow("not_object", "<row>", f"expected a JSON object, got {type(row).__name__}")
    response_key = next((k for k in ("response", "completion", "chosen") if row.get(k) is not None), None)
    if row.get("messages") is not None:
        messages, where = parse_messages(row["messages"], "messages", allow_string=False), "messages"
    elif row.get("prompt") is not None and response_key:
        prompt = parse_messages(row["prompt"], "prompt", allow_string=True)
        messages, where = (
            [*prompt, {"role": "assistant", "content": parse_response(row[response_key], response_key)}],
            response_key,
        )
    elif isinstance(row.get("chosen"), str):
        messages, where = split_hh_dialogue(row["chosen"], "chosen"), "chosen"
    elif row.get("chosen") is not None:
        messages, where = parse_messages(row["chosen"], "chosen", allow_string=False), "chosen"
    else:
        raise InvalidRow(
            "missing_field", "messages", "expected 'messages', 'prompt' with 'response', or a preference row's 'chosen'"
        )
    if messages[-1]["role"] != "assistant":
        raise InvalidRow("bad_message", where, f"the last message must be 'assistant', got {messages[-1]['role']!r}")
    if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
        raise DroppedRow("empty_response")
    return messages
