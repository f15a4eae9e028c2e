"""Build the CPU GRPO recipe's prompts (data/grpo/numbers.jsonl): a digit N asked back four ways ("Repeat the number
N.", ...) as chat messages, each record's ``answer`` the digit (what ``math_answer`` checks a completion against): the
answer is in the question, so no constant answer scores well (one in ten). Deterministic: the same file every time.

    python scripts/make_grpo_data.py [--output data/grpo/numbers.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ASKS = ("Repeat the number {}.", "Say the number {}.", "Write the digit {}.", "Which number is this: {}?")


def records() -> list[dict]:
    """Every digit, asked every way."""
    return [{"prompt": [{"role": "user", "content": ask.format(n)}], "answer": str(n)} for ask in ASKS for n in range(10)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=os.path.join(ROOT, "data", "grpo", "numbers.jsonl"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records()))
    print(f"{len(records())} prompts -> {args.output}")


if __name__ == "__main__":
    main()
