"""Hypothesis fuzzing: no input to data preparation or config loading ends in an unexplained
traceback, and every rejected row is reported with its file and line."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_prep.preference_rows import DroppedRow, InvalidRow, parse_preference_row
from data_prep.prepare_preferences import Tally, read_pairs
from data_prep.sources import DataError
from engine.config import ConfigError, build_config
from engine.run_config import SCRIPT_CONFIGS

ROW_KEYS = ["prompt", "chosen", "rejected", "margin", "components", "role", "content", "extra"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["\n\nHuman: hi\n\nAssistant: yo", "\n\nAssistant:", "user", "assistant"]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.sampled_from(ROW_KEYS), children, max_size=5)
    ),
    max_leaves=12,
)
rows = st.one_of(json_values, st.dictionaries(st.sampled_from(ROW_KEYS), json_values, max_size=6))


@settings(max_examples=500, deadline=None)
@given(row=rows)
def test_any_row_parses_or_is_rejected_with_a_reason(row):
    try:
        parse_preference_row(row)
    except (InvalidRow, DroppedRow) as e:
        assert e.reason and re.fullmatch(r"[a-z_]+", e.reason)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(
        st.one_of(rows.map(json.dumps), st.text(max_size=40).filter(lambda t: "\n" not in t and "\r" not in t)),
        min_size=1,
        max_size=8,
    )
)
def test_any_file_reads_or_fails_naming_file_and_line(lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        try:
            read_pairs([str(path)], "train", skip_invalid=False, tally=Tally())
        except DataError as e:
            assert re.match(rf"{re.escape(str(path))}:\d+: field '", str(e)), str(e)
        tally = Tally()
        read_pairs([str(path)], "train", skip_invalid=True, tally=tally)
        assert tally.read == sum(1 for line in lines if line.strip())


config_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(
            st.sampled_from(["path", "train", "lr", "seed", "components", "stage", "rm", "ppo", "x"]),
            children,
            max_size=4,
        ),
    ),
    max_leaves=10,
)
section_names = [
    "model",
    "actor",
    "data",
    "rm",
    "train",
    "optim",
    "checkpoint",
    "logging",
    "deepspeed",
    "ppo",
    "rollout",
    "critic",
    "dpo",
    "nope",
]


@settings(max_examples=300, deadline=None)
@given(
    data=st.dictionaries(st.sampled_from(section_names), config_values, max_size=6),
    script=st.sampled_from(sorted(SCRIPT_CONFIGS)),
)
def test_any_config_builds_or_is_refused_naming_the_file(data, script):
    try:
        build_config(SCRIPT_CONFIGS[script], data, source="run.json")
    except ConfigError as e:
        assert str(e).startswith("run.json: ")
