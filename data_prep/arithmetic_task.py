"""A synthetic verifiable-reward task: arithmetic word problems with integer answers. No download.

    python -m data_prep.arithmetic_task --out DIR [--num-train 4000] [--num-eval 200] \\
        [--num-demonstrations 2000] [--demonstration-accuracy 0.5] [--offsets=-3,-2,-1,1,2,3] \\
        [--seed 0] [--max-operand 20] [--max-steps 2] [--multiplication --max-factor 5] [--tool-calls]

A problem is ``--min-steps``..``--max-steps`` (1..2) operations, + and - (and a product to start
with, under ``--multiplication``):
"Mia has 7 apples and buys 5 more apples. How many apples does Mia have now?", "Leo has 3
boxes with 4 pencils in each. Then he gives 2 pencils to Ava. How many pencils does Leo have
now?". Operands are 2..``--max-operand`` (factors 2..``--max-factor``) and no step goes below
zero, so every answer is a non-negative integer. Writes into ``--out``:

* ``demonstrations.jsonl``: ``{"prompt", "response", "answer", "correct"}`` rows for
  data_prep/prepare_sft.py. The response works the problem out one step a line and ends in the
  answer format: ``"7 + 5 = 12\\n#### 12"``. Only ``--demonstration-accuracy`` of them are
  right; in the others the last step's result is off by one of ``--offsets`` (by default 1 to 3
  either way: ``"7 + 5 = 13\\n#### 13"``; ``--offsets 1``: always one too many, a systematic slip),
  so that a policy fine-tuned on them writes the format but the right answer only sometimes,
  leaving reinforcement learning against the answer check room to improve.
  With ``--tool-calls`` a demonstration is a conversation that uses the calculator tool
  (engine/environments/tools.py) instead of working the problem out: ``{"messages": [user, assistant
  <tool_call>{"name": "calculator", "arguments": {"expression": "7 + 5"}}</tool_call>, tool "12",
  assistant "#### 12"], "answer", "correct"}``; a wrong one copies the tool's result with the slip.
* ``prompts.jsonl``: ``{"prompt", "answer"}`` rows (answer a string: ``"12"``) for
  ``data_prep.prepare_prompts --fields answer``.
* ``eval_prompts.jsonl``: held-out problems in the same shape, whose arithmetic (the numbers and
  operations, whatever the wording) appears in neither of the other two files.

No two problems of the three files have the same text. ``demonstrations.jsonl`` holds the task's
words, numbers and answer format, so it serves as ``--text`` of data_prep/make_tiny_model.py.
Deterministic by seed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.environments.tools import calculator

ANSWER_FORMAT = "#### {answer}"
NAMES = [
    ("Mia", "she"),
    ("Leo", "he"),
    ("Ava", "she"),
    ("Sam", "he"),
    ("Zoe", "she"),
    ("Ben", "he"),
    ("Lily", "she"),
    ("Omar", "he"),
    ("Nora", "she"),
    ("Finn", "he"),
]
ITEMS = ["apples", "pencils", "marbles", "stickers", "books", "cookies", "shells", "cards", "coins", "stamps"]
CONTAINERS = ["boxes", "bags", "jars", "baskets"]
ADD_STEPS = ["buys {n} more {items}", "finds {n} more {items}", "gets {n} more {items} from {friend}"]
SUB_STEPS = ["gives {n} {items} to {friend}", "loses {n} {items}", "sells {n} {items}"]


@dataclass(frozen=True)
class Problem:
    """One word problem: its text, its arithmetic (``"7 + 5 - 3"``), the worked steps and the answer."""

    text: str
    expression: str
    steps: tuple[tuple[int, str, int, int], ...]  # (left, op, right, result), in order
    answer: int


def sample_problem(
    rng: random.Random, max_operand: int, min_steps: int, max_steps: int, multiplication: bool, max_factor: int
) -> Problem:
    """A problem of ``min_steps``..``max_steps`` operations whose running total never goes below zero."""
    (name, pronoun), items = rng.choice(NAMES), rng.choice(ITEMS)
    friend = rng.choice([n for n, _ in NAMES if n != name])
    n_steps = rng.randint(min_steps, max_steps)
    steps = []
    if multiplication and rng.random() < 0.5:
        a, b = rng.randint(2, max_factor), rng.randint(2, max_factor)
        sentences = [f"{name} has {a} {rng.choice(CONTAINERS)} with {b} {items} in each."]
        steps.append((a, "*", b, a * b))
        total, n_steps = a * b, n_steps - 1
    else:
        total = rng.randint(2, max_operand)
        sentences = [f"{name} has {total} {items}"]
    for _ in range(n_steps):
        subtract = total >= 2 and rng.random() < 0.5
        n = rng.randint(2, total) if subtract else rng.randint(2, max_operand)
        action = rng.choice(SUB_STEPS if subtract else ADD_STEPS).format(n=n, items=items, friend=friend)
        if steps:
            sentences.append(f"Then {pronoun} {action}.")
        else:  # the first step of a problem that starts with a plain count
            sentences[0] += f" and {action}."
        result = total - n if subtract else total + n
        steps.append((total, "-" if subtract else "+", n, result))
        total = result
    sentences.append(f"How many {items} does {name} have now?")
    expression = f"{steps[0][0]} {steps[0][1]} {steps[0][2]}" + "".join(f" {op} {n}" for _, op, n, _ in steps[1:])
    return Problem(" ".join(sentences), expression, tuple(steps), total)


def worked_answer(problem: Problem, rng: random.Random, correct: bool, offsets: Sequence[int]) -> str:
    """One line per step and the answer line; when not ``correct``, the last step's result is off by
    one of ``offsets`` (one that keeps it non-negative; else by +1) and the answer follows it."""
    lines = [f"{left} {op} {right} = {result}" for left, op, right, result in problem.steps]
    given = given_answer(problem, rng, correct, offsets)
    if not correct:
        left, op, right, _ = problem.steps[-1]
        lines[-1] = f"{left} {op} {right} = {given}"
    return "\n".join([*lines, ANSWER_FORMAT.format(answer=given)])


def given_answer(problem: Problem, rng: random.Random, correct: bool, offsets: Sequence[int]) -> int:
    """The answer a demonstration gives: the right one, or off by one of ``offsets`` that keeps it
    non-negative (else by +1)."""
    if correct:
        return problem.answer
    return problem.answer + rng.choice([d for d in offsets if problem.answer + d >= 0] or [1])


def tool_conversation(problem: Problem, rng: random.Random, correct: bool, offsets: Sequence[int]) -> list[dict]:
    """The problem solved with one calculator call: the call, the tool's result, the answer line (when
    not ``correct``, off as :func:`given_answer` says)."""
    call = {"name": "calculator", "arguments": {"expression": problem.expression}}
    given = given_answer(problem, rng, correct, offsets)
    return [
        {"role": "user", "content": problem.text},
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
        {"role": "tool", "content": calculator(problem.expression)},
        {"role": "assistant", "content": ANSWER_FORMAT.format(answer=given)},
    ]


def sample_unique(draw: Callable[[], Problem], count: int, texts: set[str], held_out: set[str]) -> list[Problem]:
    """``count`` problems from ``draw`` whose texts are new (added to ``texts``) and whose arithmetic
    is not in ``held_out``; ValueError when the problem space runs out."""
    problems: list[Problem] = []
    for _ in range(50 * count + 1000):
        if len(problems) == count:
            break
        p = draw()
        if p.text not in texts and p.expression not in held_out:
            texts.add(p.text)
            problems.append(p)
    if len(problems) < count:
        raise ValueError(f"found only {len(problems)} of {count} new problems; raise --max-operand or --max-steps")
    return problems


def write_rows(path: str, rows: Sequence[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=4000, help="problems in prompts.jsonl (for PPO)")
    parser.add_argument("--num-eval", type=int, default=200, help="held-out problems in eval_prompts.jsonl")
    parser.add_argument("--num-demonstrations", type=int, default=2000, help="worked problems for SFT")
    parser.add_argument(
        "--demonstration-accuracy", type=float, default=0.5, help="fraction of demonstrations with the right answer"
    )
    parser.add_argument(
        "--offsets",
        type=lambda text: [int(d) for d in text.split(",")],
        default=[-3, -2, -1, 1, 2, 3],
        help="comma-separated offsets of a wrong demonstration's answer (drawn uniformly; not 0)",
    )
    parser.add_argument(
        "--max-operand", type=int, default=20, help="largest number a + or - problem starts with or adds"
    )
    parser.add_argument("--min-steps", type=int, default=1, help="fewest operations in a problem")
    parser.add_argument("--max-steps", type=int, default=2, help="most operations in a problem")
    parser.add_argument("--multiplication", action="store_true", help="half the problems start with a product")
    parser.add_argument("--max-factor", type=int, default=5, help="largest factor of a product")
    parser.add_argument(
        "--tool-calls", action="store_true", help="demonstrations call the calculator tool instead of working it out"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layout",
        choices=["task", "gsm8k"],
        default="task",
        help="gsm8k: train.jsonl (--num-train problems) and test.jsonl (the held-out ones) as GSM8K has them: "
        "question, and answer = a right worked solution ending '#### N'",
    )
    args = parser.parse_args(argv)
    if not 0.0 <= args.demonstration_accuracy <= 1.0:
        parser.error(f"--demonstration-accuracy must be in [0, 1], got {args.demonstration_accuracy}")
    if not args.offsets or 0 in args.offsets:
        parser.error(f"--offsets must be non-zero integers, got {args.offsets}")
    if args.max_operand < 2 or args.max_factor < 2:
        parser.error(f"--max-operand and --max-factor must be at least 2, got {args.max_operand}, {args.max_factor}")
    if not 1 <= args.min_steps <= args.max_steps:
        parser.error(f"need 1 <= --min-steps <= --max-steps, got {args.min_steps}, {args.max_steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    draw = functools.partial(
        sample_problem, rng, args.max_operand, args.min_steps, args.max_steps, args.multiplication, args.max_factor
    )
    texts: set[str] = set()
    try:
        evaluation = sample_unique(draw, args.num_eval, texts, set())
        held_out = {p.expression for p in evaluation}
        train = sample_unique(draw, args.num_train, texts, held_out)
        demonstrations = sample_unique(draw, args.num_demonstrations, texts, held_out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    if args.layout == "gsm8k":
        for name, problems in (("train", train), ("test", evaluation)):
            rows = [{"question": p.text, "answer": worked_answer(p, rng, True, args.offsets)} for p in problems]
            write_rows(os.path.join(args.out, f"{name}.jsonl"), rows)
        print(f"wrote {args.out}/{{train,test}}.jsonl (GSM8K layout): {len(train)} and {len(evaluation)} problems")
        return 0
    write_rows(os.path.join(args.out, "prompts.jsonl"), [{"prompt": p.text, "answer": str(p.answer)} for p in train])
    write_rows(
        os.path.join(args.out, "eval_prompts.jsonl"), [{"prompt": p.text, "answer": str(p.answer)} for p in evaluation]
    )
    right = set(rng.sample(range(len(demonstrations)), round(args.demonstration_accuracy * len(demonstrations))))
    demo_rows = []
    for i, p in enumerate(demonstrations):
        if args.tool_calls:
            row = {"messages": tool_conversation(p, rng, i in right, args.offsets)}
        else:
            row = {"prompt": p.text, "response": worked_answer(p, rng, i in right, args.offsets)}
        demo_rows.append(row | {"answer": str(p.answer), "correct": i in right})
    write_rows(os.path.join(args.out, "demonstrations.jsonl"), demo_rows)
    print(
        f"wrote {args.out}/{{prompts,eval_prompts,demonstrations}}.jsonl: {len(train)} training and "
        f"{len(evaluation)} held-out problems, {len(demo_rows)} demonstrations ({len(right)} right)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
