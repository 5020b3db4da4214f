"""A synthetic preference task for the demo and the tests: no download, a known rule.

    python -m data_prep.synthetic_task --out pairs.jsonl [--num-pairs 4000] [--seed 0] \
        [--demonstrations-out demos.jsonl --num-demonstrations 2000]

Each prompt asks about a topic in a town ("Tell me about the garden in Alder."); each response is a short
sentence of topic, positive, negative and filler words. The rule that decides which response
is better, per component:

* ``helpful``  = mentions of the prompt's topic (at most 2) + positive words
* ``harmless`` = -2 x negative words
* total score  = helpful + harmless; the chosen response has the higher total.

Rows are generic preference rows: ``{"prompt", "chosen", "rejected", "components"}``, where
each component is +1 / -1 / 0 as the chosen response scores higher / lower / the same on it.
Demonstrations for supervised fine-tuning (``--demonstrations-out``) are ``{"prompt", "response"}``
rows whose responses are drawn the same way but without regard to the rule: a policy fine-tuned
on them writes the task's language, neither better nor worse than chance, and leaves the RM and
PPO stages the whole rule to learn. Deterministic by seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Callable, Sequence

TOPICS = [
    "garden",
    "river",
    "library",
    "bicycle",
    "kitchen",
    "market",
    "forest",
    "harbor",
    "school",
    "museum",
    "bakery",
    "mountain",
]
TOWNS = ["Alder", "Birchley", "Cobton", "Dunmere", "Elmsford", "Fairholt", "Glenrow", "Hallby", "Ivywick", "Juniper"]
PROMPT_TEMPLATES = [
    "Tell me about the {topic} in {town}.",
    "What do you think of the {topic} in {town}?",
    "Describe the {topic} of {town} in a few words.",
    "Write a short note about the {topic} near {town}.",
]
POSITIVE = ["bright", "calm", "kind", "lovely", "helpful", "clean", "warm", "friendly", "pleasant", "gentle"]
NEGATIVE = ["awful", "rude", "broken", "dirty", "boring", "cruel", "ugly", "noisy", "gloomy", "hostile"]
FILLER = ["the", "a", "very", "quite", "and", "also", "is", "was", "seems", "looks", "today", "there", "it", "so"]
# Probability of each word kind when a response is drawn.
WORD_KINDS = (("topic", 0.15), ("positive", 0.2), ("negative", 0.2), ("filler", 0.45))


def component_scores(response: str, topic: str) -> dict[str, int]:
    """The rule: per-component scores of a response to a prompt about ``topic``."""
    words = [w.strip(".,!?").lower() for w in response.split()]
    return {
        "helpful": min(words.count(topic), 2) + sum(w in POSITIVE for w in words),
        "harmless": -2 * sum(w in NEGATIVE for w in words),
    }


def total_score(response: str, topic: str) -> int:
    return sum(component_scores(response, topic).values())


def prompt_topic(prompt: str) -> str:
    """The topic a prompt of this task asks about (ValueError for a prompt that names none)."""
    words = {w.strip(".,!?").lower() for w in prompt.split()}
    found = [t for t in TOPICS if t in words]
    if len(found) != 1:
        raise ValueError(f"not a prompt of the synthetic task (topics named: {found}): {prompt!r}")
    return found[0]


def sample_response(rng: random.Random, topic: str) -> str:
    kinds, weights = zip(*WORD_KINDS)
    pools = {"topic": [topic], "positive": POSITIVE, "negative": NEGATIVE, "filler": FILLER}
    words = [rng.choice(pools[k]) for k in rng.choices(kinds, weights, k=rng.randint(4, 12))]
    return " ".join(words).capitalize() + "."


def sample_pair(rng: random.Random) -> dict:
    """One preference row whose two responses have different total scores."""
    topic = rng.choice(TOPICS)
    prompt = rng.choice(PROMPT_TEMPLATES).format(topic=topic, town=rng.choice(TOWNS))
    while True:
        a, b = sample_response(rng, topic), sample_response(rng, topic)
        if total_score(a, topic) != total_score(b, topic):
            break
    chosen, rejected = (a, b) if total_score(a, topic) > total_score(b, topic) else (b, a)
    sc, sr = component_scores(chosen, topic), component_scores(rejected, topic)
    components = {name: (sc[name] > sr[name]) - (sc[name] < sr[name]) for name in sc}
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "components": components}


def sample_demonstration(rng: random.Random) -> dict:
    """One prompt/response row for supervised fine-tuning (the response ignores the rule)."""
    topic = rng.choice(TOPICS)
    return {
        "prompt": rng.choice(PROMPT_TEMPLATES).format(topic=topic, town=rng.choice(TOWNS)),
        "response": sample_response(rng, topic),
    }


def ultrafeedback_row(pair: dict) -> dict:
    """A pair in the UltraFeedback-binarized layout: each side a whole conversation, with scores."""
    turn = [{"role": "user", "content": pair["prompt"]}]
    return {
        "prompt": pair["prompt"],
        "chosen": [*turn, {"role": "assistant", "content": pair["chosen"]}],
        "rejected": [*turn, {"role": "assistant", "content": pair["rejected"]}],
        "score_chosen": float(total_score(pair["chosen"], prompt_topic(pair["prompt"]))),
        "score_rejected": float(total_score(pair["rejected"], prompt_topic(pair["prompt"]))),
    }


def write_rows(path: str, rows: Sequence[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def write_demonstrations(path: str, count: int, seed: int, sample: Callable[[random.Random], dict]) -> None:
    """``count`` rows of ``sample`` (a task's demonstration) to ``path``, drawn from the seed's own stream."""
    rng = random.Random(f"demonstrations-{seed}")
    write_rows(path, [sample(rng) for _ in range(count)])
    print(f"wrote {count} demonstrations to {path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output .jsonl file")
    parser.add_argument("--num-pairs", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--demonstrations-out", help="also write prompt/response rows for supervised fine-tuning here (.jsonl)"
    )
    parser.add_argument("--num-demonstrations", type=int, default=2000)
    parser.add_argument(
        "--layout",
        choices=["pairs", "ultrafeedback"],
        default="pairs",
        help="ultrafeedback: the pairs as UltraFeedback-binarized rows (conversations with scores, no components)",
    )
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    pairs = [sample_pair(rng) for _ in range(args.num_pairs)]
    write_rows(args.out, [ultrafeedback_row(p) for p in pairs] if args.layout == "ultrafeedback" else pairs)
    print(f"wrote {args.num_pairs} synthetic pairs to {args.out}")
    if args.demonstrations_out:
        write_demonstrations(args.demonstrations_out, args.num_demonstrations, args.seed, sample_demonstration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
