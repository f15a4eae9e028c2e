"""Reward functions shipped for online RL (name them in ``grpo.reward_funcs``), with TRL's signature: keyword
arguments ``completions`` (text, or one assistant message for a conversational prompt), the prompt records' columns,
``**kwargs`` for the rest; one float (or None: not scored) per completion.

    "reward_funcs": ["llama_megatron.data.reward_functions:math_answer",
                     "llama_megatron.data.reward_functions:think_format"]

``math_answer`` checks a completion's answer against the record's ``answer`` column with Hugging Face's
``math-verify`` (``pip install 'llama_megatron[rl]'``): the gold answer and the completion's answer (a
``\\boxed{}`` one first, then one after "the answer is", else the last LaTeX or plain expression: math-verify's
final-answer rule) are parsed and compared as mathematical objects, so ``\\frac{1}{2}``, ``0.5`` and ``1/2`` agree; a
gold answer it cannot parse is not scored (None), as TRL's ``accuracy_reward`` does. TRL's reads LaTeX only; ours
takes plain numbers too, which is what small models write.
``first_number_answer`` is 1 where the completion's first number is the ``answer`` (a model that answers with
several numbers: the CPU recipe's). ``think_format`` is 1 for a completion that is its reasoning in one
``<think>...</think>`` block, then the answer.
"""

from __future__ import annotations

import re
import threading

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def _text(completion) -> str:
    """A completion's text: a string, or the content of its one assistant message (a conversational prompt's)."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def math_answer(completions: list, answer: list, **kwargs) -> list[float | None]:
    """1.0 where the completion's answer equals the record's ``answer`` mathematically, else 0.0; None where the
    gold answer does not parse."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError("math_answer needs math-verify: pip install 'llama_megatron[rl]'") from None
    # math-verify bounds its parsing with signal.alarm, which only the main thread may set
    main = threading.current_thread() is threading.main_thread()
    timeouts = {"parsing_timeout": 10 if main else None}
    extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0),
                  ExprExtractionConfig()]
    rewards: list[float | None] = []
    for completion, gold_text in zip(completions, answer, strict=True):
        gold = parse(str(gold_text), **timeouts)
        if not gold:
            rewards.append(None)
            continue
        found = parse(_text(completion), extraction_config=extraction, extraction_mode="first_match", **timeouts)
        rewards.append(float(verify(gold, found, timeout_seconds=5 if main else None)))
    return rewards


# (module, how to install it): what load_reward_function checks before any process starts
math_answer.requires = (("math_verify", "pip install 'llama_megatron[rl]'"),
                        ("latex2sympy2_extended", "pip install 'llama_megatron[rl]'"))


def first_number_answer(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 where the completion's first number equals the record's ``answer`` (as numbers: "7.0" is 7), else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        found = _NUMBER.search(_text(completion))
        rewards.append(float(found is not None and float(found.group()) == float(gold)))
    return rewards


def think_format(completions: list, **kwargs) -> list[float]:
    """1.0 where the completion opens with one ``<think>...</think>`` block (and no second ``<think>``), else 0.0."""
    return [1.0 if _THINK.match(_text(completion)) else 0.0 for completion in completions]
