"""The CPU GRPO recipe's shaping reward (scripts/finetune_grpo_cpu.sh): how close the completion's first number is to
the record's ``answer``. The SFT model answers sums with numbers, rarely the right one; ``math_answer`` (the exact
check) alone gives its groups equal rewards and so no advantage, while this one ranks a group's completions from the
first step."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number_close(completions: list, answer: list, **kwargs) -> list[float]:
    """1 - |first number - answer| / 10, at least 0; 0 for a completion without a number."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        found = _NUMBER.search(text)
        rewards.append(0.0 if found is None else max(0.0, 1.0 - abs(float(found.group()) - float(gold)) / 10.0))
    return rewards
