"""A second synthetic task, for a reward model that is often wrong: lists of words of a category.

    python -m data_prep.list_task --out pairs.jsonl [--num-pairs 600] [--noise 0.1] [--length-share 0.15] \
        [--seed 0] [--demonstrations-out demos.jsonl --num-demonstrations 2000]

Each prompt asks for words of one category ("List some colours for Mia."); each response is a
comma-separated list of 2 to 11 words ("amber, otter, teal, amber"), drawn from that category
with a probability drawn per response, from the other categories otherwise. The true score
(:func:`true_score`) is the share of the list that is distinct words of the asked category:
``|distinct category words| / |words|`` in [0, 1]. Length earns nothing: a longer list repeats
itself more often, so the true score falls a little with length.

Preference rows ``{"prompt", "chosen", "rejected", "label"}`` pair two responses to one prompt
whose true scores differ, labelled as a careless annotator would (:func:`label_pair`): a
``--length-share`` of pairs by "the longer list wins" (``label`` "length"; by the rule where both
are as long), the others by the rule, flipped with probability ``--noise`` ("flipped", else
"rule"). The labels agree with the rule on about 84% of pairs and favour longer lists: a spurious
preference the true score does not share.
Demonstrations for supervised fine-tuning are drawn the same way without regard to the rule, as
data_prep/synthetic_task.py's are. Deterministic by seed.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence

from data_prep.synthetic_task import write_demonstrations, write_rows

CATEGORIES = {
    "colours": ["amber", "teal", "crimson", "olive", "violet", "indigo", "scarlet", "ivory", "maroon", "cyan"],
    "animals": ["otter", "badger", "lynx", "beaver", "ferret", "weasel", "bison", "moose", "walrus", "jackal"],
    "fruits": ["plum", "mango", "guava", "lychee", "papaya", "apricot", "quince", "kiwi", "lemon", "cherry"],
    "tools": ["hammer", "chisel", "wrench", "pliers", "trowel", "shovel", "sander", "drill", "mallet", "rasp"],
    "instruments": ["violin", "cello", "oboe", "flute", "harp", "tuba", "banjo", "lute", "cornet", "bassoon"],
    "trees": ["oak", "maple", "birch", "cedar", "willow", "aspen", "spruce", "alder", "hazel", "rowan"],
}
NAMES = ["Mia", "Leo", "Ava", "Sam", "Noor", "Ravi", "Yuki", "Ines", "Omar", "Zoe"]
PROMPT_TEMPLATES = [
    "List some {category} for {name}.",
    "Name a few {category} that {name} might like.",
    "Give {name} a list of {category}.",
    "Which {category} could {name} pick?",
]
MIN_WORDS, MAX_WORDS = 2, 11


def list_words(response: str) -> list[str]:
    """The response's list items, lower-cased: its comma-separated, non-empty parts."""
    return [w for w in (part.strip(" .!?").lower() for part in response.split(",")) if w]


def true_score(response: str, category: str) -> float:
    """The rule: the share of the list's items that are distinct words of ``category`` (0 for no items)."""
    words = list_words(response)
    return len(set(words) & set(CATEGORIES[category])) / len(words) if words else 0.0


def prompt_category(prompt: str) -> str:
    """The category a prompt of this task asks for (ValueError for a prompt that names none)."""
    words = {w.strip(".,!?").lower() for w in prompt.split()}
    found = [c for c in CATEGORIES if c in words]
    if len(found) != 1:
        raise ValueError(f"not a prompt of the list task (categories named: {found}): {prompt!r}")
    return found[0]


def sample_prompt(rng: random.Random) -> tuple[str, str]:
    """(prompt, its category)."""
    category = rng.choice(sorted(CATEGORIES))
    return rng.choice(PROMPT_TEMPLATES).format(category=category, name=rng.choice(NAMES)), category


def sample_response(rng: random.Random, category: str) -> str:
    """A list of 2-11 words, each of ``category`` with a probability drawn once for the list."""
    on_topic = rng.random()
    others = [w for c, words in sorted(CATEGORIES.items()) if c != category for w in words]
    count = rng.randint(MIN_WORDS, MAX_WORDS)
    return ", ".join(rng.choice(CATEGORIES[category] if rng.random() < on_topic else others) for _ in range(count))


def label_pair(a: str, b: str, category: str, rng: random.Random, noise: float, length_share: float) -> tuple[str, str]:
    """(which of ``a`` and ``b`` is chosen, how it was decided: "length", "rule" or "flipped").
    ``a`` and ``b`` must have different true scores."""
    by_rule = a if true_score(a, category) > true_score(b, category) else b
    if rng.random() < length_share and len(list_words(a)) != len(list_words(b)):
        return (a if len(list_words(a)) > len(list_words(b)) else b), "length"
    if rng.random() < noise:
        return (b if by_rule == a else a), "flipped"
    return by_rule, "rule"


def sample_pair(rng: random.Random, noise: float, length_share: float) -> dict:
    """One preference row whose two responses have different true scores."""
    prompt, category = sample_prompt(rng)
    while True:
        a, b = sample_response(rng, category), sample_response(rng, category)
        if true_score(a, category) != true_score(b, category):
            break
    chosen, label = label_pair(a, b, category, rng, noise, length_share)
    return {"prompt": prompt, "chosen": chosen, "rejected": b if chosen == a else a, "label": label}


def sample_demonstration(rng: random.Random) -> dict:
    """One prompt/response row for supervised fine-tuning (the response ignores the rule)."""
    prompt, category = sample_prompt(rng)
    return {"prompt": prompt, "response": sample_response(rng, category)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output .jsonl file of preference pairs")
    parser.add_argument("--num-pairs", type=int, default=600)
    parser.add_argument("--noise", type=float, default=0.1, help="share of rule-labelled pairs flipped")
    parser.add_argument("--length-share", type=float, default=0.15, help="share of pairs labelled 'longer wins'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--demonstrations-out", help="also write prompt/response rows for supervised fine-tuning here (.jsonl)"
    )
    parser.add_argument("--num-demonstrations", type=int, default=2000)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    write_rows(args.out, [sample_pair(rng, args.noise, args.length_share) for _ in range(args.num_pairs)])
    print(f"wrote {args.num_pairs} list-task pairs to {args.out}")
    if args.demonstrations_out:
        write_demonstrations(args.demonstrations_out, args.num_demonstrations, args.seed, sample_demonstration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
