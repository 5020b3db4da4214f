"""Row parsing: HH-RLHF dialogues, generic rows, and every invalid / dropped reason."""

from __future__ import annotations

import pytest

from data_prep.preference_rows import DroppedRow, InvalidRow, parse_preference_row
from data_prep.sources import BadJSON


def hh(*turns: str) -> str:
    """``hh("a", "b", "c")`` -> Human a / Assistant b / Human c (alternating, Human first)."""
    return "".join(f"\n\n{'Human' if i % 2 == 0 else 'Assistant'}: {t}" for i, t in enumerate(turns))


def test_hh_single_turn():
    pair = parse_preference_row({"chosen": hh("Hi there", "Hello!"), "rejected": hh("Hi there", "Go away.")})
    assert pair.prompt == [{"role": "user", "content": "Hi there"}]
    assert (pair.chosen, pair.rejected) == ("Hello!", "Go away.")
    assert pair.margin is None and pair.components == {}


def test_hh_multi_turn_prompt_is_everything_before_the_last_assistant_turn():
    pair = parse_preference_row(
        {"chosen": hh("q1", "a1", "q2", "good\n\nanswer"), "rejected": hh("q1", "a1", "q2", "bad")}
    )
    assert pair.prompt == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert pair.chosen == "good\n\nanswer"  # paragraphs inside a response survive


def test_hh_response_mentioning_human_without_turn_break_stays_in_the_response():
    pair = parse_preference_row({"chosen": hh("q", "I said Human: hi"), "rejected": hh("q", "no")})
    assert pair.chosen == "I said Human: hi"


@pytest.mark.parametrize(
    "chosen, rejected, reason",
    [
        (hh("q", ""), hh("q", "something"), "empty_response"),
        (hh("q", "   "), hh("q", "something"), "empty_response"),
        (hh("q", "same"), hh("q", "same "), "identical_responses"),
        # one response carries an extra turn: the two dialogues diverge before the last turn
        (hh("q", "a", "q2", "x"), hh("q", "b"), "turn_mismatch"),
    ],
)
def test_hh_rows_that_are_dropped(chosen, rejected, reason):
    with pytest.raises(DroppedRow) as e:
        parse_preference_row({"chosen": chosen, "rejected": rejected})
    assert e.value.reason == reason


def test_generic_string_prompt_with_margin_and_components():
    pair = parse_preference_row(
        {"prompt": "p", "chosen": "c", "rejected": "r", "margin": 2, "components": {"helpful": 1, "harmless": -1}}
    )
    assert pair.prompt == [{"role": "user", "content": "p"}]
    assert pair.margin == 2.0 and isinstance(pair.margin, float)
    assert pair.components == {"helpful": 1, "harmless": -1}


def test_generic_message_lists():
    pair = parse_preference_row(
        {
            "prompt": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "p"}],
            "chosen": [{"role": "assistant", "content": "c"}],
            "rejected": "r",
            "id": 17,  # extra columns are ignored
        }
    )
    assert [m["role"] for m in pair.prompt] == ["system", "user"]
    assert (pair.chosen, pair.rejected) == ("c", "r")


def test_generic_conversations_without_prompt_share_a_prefix():
    prefix = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"},
    ]
    pair = parse_preference_row(
        {
            "chosen": prefix + [{"role": "assistant", "content": "c"}],
            "rejected": prefix + [{"role": "assistant", "content": "r"}],
        }
    )
    assert pair.prompt == prefix and (pair.chosen, pair.rejected) == ("c", "r")


def test_parquet_map_columns_read_back_as_pairs_are_accepted():
    pair = parse_preference_row(
        {"prompt": "p", "chosen": "c", "rejected": "r", "components": [("helpful", 1)], "margin": None}
    )
    assert pair.components == {"helpful": 1} and pair.margin is None


@pytest.mark.parametrize(
    "row, reason, field",
    [
        (BadJSON("not valid JSON"), "bad_json", "<row>"),
        ([1, 2], "not_object", "<row>"),
        ({"prompt": "p", "rejected": "r"}, "missing_field", "chosen"),
        ({"prompt": "p", "chosen": "c"}, "missing_field", "rejected"),
        ({"prompt": 5, "chosen": "c", "rejected": "r"}, "wrong_type", "prompt"),
        ({"prompt": [], "chosen": "c", "rejected": "r"}, "wrong_type", "prompt"),
        ({"prompt": ["hi"], "chosen": "c", "rejected": "r"}, "bad_message", "prompt[0]"),
        (
            {"prompt": [{"role": "robot", "content": "x"}], "chosen": "c", "rejected": "r"},
            "bad_message",
            "prompt[0].role",
        ),
        (
            {"prompt": [{"role": "user", "content": 3}], "chosen": "c", "rejected": "r"},
            "bad_message",
            "prompt[0].content",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "chosen": "c",
                "rejected": "r",
            },
            "bad_message",
            "prompt",
        ),
        ({"prompt": "p", "chosen": [{"role": "user", "content": "c"}], "rejected": "r"}, "bad_message", "chosen"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}, "bad_margin", "margin"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": float("nan")}, "bad_margin", "margin"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": True}, "bad_margin", "margin"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "components": "helpful"}, "bad_components", "components"),
        (
            {"prompt": "p", "chosen": "c", "rejected": "r", "components": {"helpful": 2}},
            "bad_components",
            "components.helpful",
        ),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "components": [1, 2]}, "bad_components", "components"),
        ({"chosen": "no turns here", "rejected": hh("q", "r")}, "bad_dialogue", "chosen"),
        ({"chosen": "preamble" + hh("q", "c"), "rejected": "preamble" + hh("q", "r")}, "bad_dialogue", "chosen"),
        (
            {"chosen": [{"role": "assistant", "content": "c"}], "rejected": [{"role": "assistant", "content": "r"}]},
            "missing_field",
            "prompt",
        ),
    ],
)
def test_invalid_rows_name_reason_and_field(row, reason, field):
    with pytest.raises(InvalidRow) as e:
        parse_preference_row(row)
    assert (e.value.reason, e.value.field_name) == (reason, field)
    assert f"field '{field}'" in str(e.value)
