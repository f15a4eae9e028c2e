"""Build the CPU GRPO recipe's prompts (data/grpo/arithmetic.jsonl): sums of two one-digit numbers asked as chat
messages, each record's ``answer`` the sum (what ``math_answer`` checks a completion against). Deterministic: the
same file every time.

    python scripts/make_grpo_data.py [--output data/grpo/arithmetic.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def records() -> list[dict]:
    """Every sum a + b with 1 <= a, b <= 9 and a <= b, asked one way."""
    return [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a in range(1, 10) for b in range(a, 10)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=os.path.join(ROOT, "data", "grpo", "arithmetic.jsonl"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records()))
    print(f"{len(records())} prompts -> {args.output}")


if __name__ == "__main__":
    main()
