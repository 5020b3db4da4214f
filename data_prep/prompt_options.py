"""What data_prep/prepare_prompts.py can add to every prompt: an instruction template over the row,
a system message, and tool schemas rendered through the chat template's ``tools=``.

    --prompt-template "{question} Let's think step by step and output the final answer after '####'."
    --system-prompt "You are a careful math tutor."
    --tools calculator,python            # built-in tools (engine/environments/tools.py), or a JSON file

The template is a Python format string over the row's columns (after the column mapping) and
``prompt``, the text of the prompt's last user turn, which it replaces. The tools are a JSON list of
schemas in the OpenAI function format (``{"type": "function", "function": {"name": ..., "parameters":
{...}}}``), carried in the prompt's messages (engine/data/chat.py: ``tools_message``) so that every
rendering of the prompt, in training too, passes them to the template.

A bad template is refused before any row is read (usage error, exit 2), a field it names that a row
lacks at that row (exit 2, even with ``--skip-invalid``); a system prompt or tools the tokenizer's
template cannot render are refused before any row is read.
"""

from __future__ import annotations

import argparse
import json
import string
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from data_prep.preference_rows import InvalidRow, Message
from data_prep.sources import DataError, OptionError
from engine.data.chat import render_prompt, tools_message
from engine.environments.tools import ToolEnvironment

PROBE = "Reply with OK."  # a message's content, rendered to see what the template does with it


@dataclass(frozen=True)
class PromptOptions:
    """The parsed options; each None when not given."""

    template: str | None = None
    system_prompt: str | None = None
    tools: list[dict[str, Any]] | None = None

    def apply(self, row: dict[str, Any], prompt: list[Message]) -> list[Message]:
        """``prompt`` (the row's, parsed) with the template applied to its last user turn, then the system
        message and the tools before it."""
        if self.template is not None:
            values = {**row, "prompt": prompt[-1]["content"]}
            if missing := [name for name in template_fields(self.template) if name not in values]:
                raise OptionError(
                    f"--prompt-template names '{missing[0]}', which this row lacks; its columns: {sorted(values)}"
                )
            try:
                text = self.template.format(**values)
            except (ValueError, TypeError) as e:  # a format spec the value's type lacks: "{n:d}" on a string
                raise OptionError(f"--prompt-template: {e}") from None
            prompt = [*prompt[:-1], {"role": "user", "content": text}]
        if self.system_prompt is not None:
            if prompt[0]["role"] == "system":
                raise InvalidRow("has_system", "prompt", "has a system message already; --system-prompt adds one")
            prompt = [{"role": "system", "content": self.system_prompt}, *prompt]
        return [tools_message(self.tools), *prompt] if self.tools else prompt

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """DataError naming the option when the tokenizer's chat template cannot render the system
        prompt, or renders a prompt the same with and without the tools."""
        user = [{"role": "user", "content": "?"}]
        if self.system_prompt is not None:
            text = _render(tokenizer, [{"role": "system", "content": PROBE}, *user], "--system-prompt")
            if PROBE not in text:
                raise DataError(f"--system-prompt: the chat template of {tokenizer.name_or_path} drops system messages")
        with_tools = self.tools and _render(tokenizer, [tools_message(self.tools), *user], "--tools")
        if with_tools and with_tools == _render(tokenizer, user, "--tools"):
            raise DataError(
                f"--tools: the chat template of {tokenizer.name_or_path} ignores tools= (a prompt renders the same "
                "with and without them): give one that renders them (--chat-template chatml does), or leave out --tools"
            )

    def summary(self) -> dict[str, Any]:
        """What the prompts summary records of the options."""
        names = [t["function"]["name"] for t in self.tools or []]
        return {"prompt_template": self.template, "system_prompt": self.system_prompt, "tools": names or None}


NO_OPTIONS = PromptOptions()


def _render(tokenizer: PreTrainedTokenizerBase, prompt: list[Message], option: str) -> str:
    try:
        return render_prompt(tokenizer, prompt)
    except Exception as e:  # jinja2's TemplateError and what a template's raise_exception raises
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"{option}: the chat template of {tokenizer.name_or_path} cannot render it ({first})") from None


def template_fields(template: str) -> list[str]:
    """The field names a format string reads, in order."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-template",
        metavar="FORMAT",
        help="Python format string over the row's columns and {prompt} (the last user turn's text), which it replaces",
    )
    parser.add_argument("--system-prompt", metavar="TEXT", help="a system message put before every prompt")
    parser.add_argument(
        "--tools",
        metavar="FILE_OR_NAMES",
        help=f"tool schemas rendered through the chat template's tools=: a JSON file (a list in the OpenAI function "
        f"format) or built-in names ({','.join(ToolEnvironment.tools)})",
    )


def prompt_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> PromptOptions:
    """The :class:`PromptOptions` of the parsed flags; a bad template or tools file is a usage error (exit 2)."""
    if args.prompt_template is not None:
        try:
            fields = template_fields(args.prompt_template)
        except ValueError as e:
            parser.error(f"--prompt-template: not a format string ({e})")
        if bad := [name for name in fields if not name or name.isdigit() or any(c in name for c in ".[")]:
            parser.error(f"--prompt-template: {{{bad[0]}}} is not a column name (use {{prompt}} or {{column}})")
        if not fields:
            parser.error("--prompt-template names no field: every prompt would be the same text (use {prompt})")
    tools = None
    if args.tools is not None:
        try:
            tools = load_tools(args.tools)
        except ValueError as e:
            parser.error(str(e))
    return PromptOptions(args.prompt_template, args.system_prompt, tools)


def load_tools(given: str) -> list[dict[str, Any]]:
    """The schemas of ``given``: a JSON file or comma-separated built-in tool names; ValueError naming
    the file and item, or the unknown name."""
    if given.endswith(".json"):
        try:
            with open(given, encoding="utf-8") as f:
                tools = json.load(f)
        except OSError as e:
            raise ValueError(f"--tools {given}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--tools {given}:{e.lineno}: not valid JSON ({e.msg})") from None
        check_tools(tools, given)
        return tools
    from transformers.utils import get_json_schema

    names = [name.strip() for name in given.split(",") if name.strip()]
    if unknown := [name for name in names if name not in ToolEnvironment.tools]:
        raise ValueError(
            f"--tools: no built-in tool {unknown[0]!r} (built-in: {', '.join(ToolEnvironment.tools)}; files end .json)"
        )
    return [get_json_schema(ToolEnvironment.tools[name]) for name in names]


def check_tools(tools: Any, path: str) -> None:
    """ValueError naming ``path`` and the item unless ``tools`` is a non-empty list of OpenAI function schemas."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"--tools {path}: expected a non-empty JSON list of tool schemas")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type") != "function"
            or not isinstance(function.get("name"), str)
        ):
            raise ValueError(
                f'--tools {path}: item {i}: expected {{"type": "function", "function": {{"name": ..., '
                '"parameters": {...}}}'
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"--tools {path}: item {i}: 'parameters' must be a JSON schema object")
