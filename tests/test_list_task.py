"""The list task's true rule and its careless labelling (data_prep/list_task.py)."""

import random

import pytest

from data_prep.list_task import label_pair, list_words, main, prompt_category, sample_pair, true_score


def test_true_score_is_the_share_of_distinct_words_of_the_category():
    assert true_score("amber, teal, otter, amber", "colours") == 2 / 4  # the repeat and the animal count against
    assert true_score("Amber, TEAL.", "colours") == 1.0
    assert true_score("amber, teal", "animals") == 0.0
    assert true_score("amber, , teal, lemon,", "colours") == 2 / 3  # empty items are no items
    assert true_score("", "colours") == 0.0
    assert list_words(" plum,kiwi ,  lime!") == ["plum", "kiwi", "lime"]


def test_prompt_category():
    assert prompt_category("Give Zoe a list of trees.") == "trees"
    with pytest.raises(ValueError, match="categories named"):
        prompt_category("List some colours and fruits.")


def test_label_pair_by_length_by_rule_and_flipped():
    rng = random.Random(0)
    short_good, long_bad = "amber, teal", "amber, otter, lemon"  # rule: 1.0 against 1/3
    for a, b in ((short_good, long_bad), (long_bad, short_good)):
        assert label_pair(a, b, "colours", rng, noise=0.0, length_share=1.0) == (long_bad, "length")
        assert label_pair(a, b, "colours", rng, noise=0.0, length_share=0.0) == (short_good, "rule")
        assert label_pair(a, b, "colours", rng, noise=1.0, length_share=0.0) == (long_bad, "flipped")
    same_length = "amber, otter"  # as long as short_good: the rule decides
    assert label_pair(same_length, short_good, "colours", rng, noise=0.0, length_share=1.0) == (short_good, "rule")


def test_pairs_label_shares_and_seed(tmp_path):
    rng = random.Random(1)
    rows = [sample_pair(rng, noise=0.2, length_share=0.3) for _ in range(2000)]
    for row in rows:
        category = prompt_category(row["prompt"])
        chosen, rejected = true_score(row["chosen"], category), true_score(row["rejected"], category)
        assert chosen != rejected
        assert (chosen > rejected) == (row["label"] == "rule") or row["label"] == "length"
        if row["label"] == "length":
            assert len(list_words(row["chosen"])) > len(list_words(row["rejected"]))
    # A length draw falls back to the rule when both lists are as long (about 1 pair in 10).
    shares = {label: sum(r["label"] == label for r in rows) / len(rows) for label in ("length", "flipped")}
    assert 0.22 < shares["length"] < 0.30
    assert 0.7 * 0.2 - 0.03 < shares["flipped"] < 0.8 * 0.2 + 0.03
    for name in ("a", "b"):
        assert main(["--out", str(tmp_path / f"{name}.jsonl"), "--num-pairs", "20", "--seed", "3"]) == 0
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
