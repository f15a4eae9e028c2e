"""Reward functions (llama_megatron/data/rewards.py): loaded by ``module:function`` (TRL's own shipped
``think_format_reward``) or ``file.py:function``, called with TRL's keyword arguments (prompts, completions,
completion ids, the records' other columns, what the caller adds), None kept as NaN; and every way a user's
function can be wrong, one line each, naming it. One process."""

from __future__ import annotations

import math

import pytest
import torch

from llama_megatron.data.rewards import load_reward_function, score
from llama_megatron.errors import ConfigError, DataError

USER_REWARDS = '''
def contains_answer(prompts, completions, completion_ids, answer, **kwargs):
    """1 where the completion holds the record's answer; None where the record has none."""
    assert len(prompts) == len(completions) == len(completion_ids) == len(answer)
    return [None if a is None else float(a in c) for c, a in zip(completions, answer)]


def shorter_is_better(completion_ids, step, **kwargs):
    return [-len(ids) / (1 + step) for ids in completion_ids]


def raises(**kwargs):
    raise ValueError("the grader's cache is gone\\nsecond line")


def too_few(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def a_word(completions, **kwargs):
    return ["high"] * len(completions)


def infinite(completions, **kwargs):
    return [float("inf")] * len(completions)


NOT_CALLABLE = 3


def graded(completions, **kwargs):
    import no_such_grader_package  # imported when called, as math_answer imports math-verify
    return [1.0] * len(completions)


graded.requires = (("no_such_grader_package", "pip install no-such-grader"),)
'''


@pytest.fixture()
def user_file(tmp_path) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS, encoding="utf-8")
    return str(path)


def test_rewards_are_called_as_trl_calls_them(user_file, tmp_path) -> None:
    trl_format = load_reward_function("trl.rewards:think_format_reward")
    answer = load_reward_function(f"{user_file}:contains_answer")
    relative = load_reward_function("my_rewards.py:shorter_is_better", base_dir=str(tmp_path))
    assert (trl_format.name, answer.name, relative.name) == ("think_format_reward", "contains_answer",
                                                             "shorter_is_better")
    completions = [[{"role": "assistant", "content": text}] for text in
                   ("<think>4 = 2 + 2</think>4", "4", "<think>x</think>five", "<think>a</think><think>b</think>")]
    plain = [c[0]["content"] for c in completions]
    ids = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    got = score([trl_format], ["q"] * 4, completions, ids)
    assert got.dtype == torch.float32 and got[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]  # TRL's own verdicts
    got = score([answer, relative], ["2 + 2?"] * 4, plain, ids, {"answer": ["4", "4", "5", None]}, step=1)
    assert got[:3, 0].tolist() == [1.0, 1.0, 0.0] and math.isnan(got[3, 0])
    assert got[:, 1].tolist() == [-1.5, -0.5, -1.0, -2.0]


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "expected module:function or path/to/file.py:function"),
    ("missing.py:f", "no file"),
    ("llama_megatron.no_such_module:f", "importing llama_megatron.no_such_module raised ModuleNotFoundError"),
    ("trl.rewards:no_such_reward", "trl.rewards has no 'no_such_reward'"),
    ("{user}:NOT_CALLABLE", "'NOT_CALLABLE' is not callable"),
    # a package the function imports only when called (its ``requires``), missing: found at load, not mid-run
    ("{user}:graded", "needs no_such_grader_package: pip install no-such-grader"),
])
def test_a_reward_that_cannot_be_loaded_is_one_line(spec, message, user_file, tmp_path) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_reward_function(spec.format(user=user_file), base_dir=str(tmp_path))
    assert "\n" not in str(caught.value)


def test_a_file_that_raises_on_import_is_one_line(tmp_path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import math\nraise RuntimeError('no grader\\nhere')\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="importing .*broken.py raised RuntimeError: no grader here") as caught:
        load_reward_function(f"{broken}:f")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name, message", [
    ("raises", "'raises' raised ValueError: the grader's cache is gone second line"),
    ("too_few", "'too_few' returned 2 rewards for 3 completions"),
    ("a_word", "'a_word' returned 'high' for completion 0: a finite number or None"),
    ("infinite", "'infinite' returned inf for completion 0"),
])
def test_a_reward_that_misbehaves_is_one_line_naming_it(name, message, user_file) -> None:
    with pytest.raises(DataError, match=message) as caught:
        score([load_reward_function(f"{user_file}:{name}")], ["p"] * 3, ["a", "b", "c"], [[1], [2], [3]])
    assert "\n" not in str(caught.value)
    with pytest.raises(DataError, match="column 'answer' has 2 values for 3 completions"):
        score([load_reward_function(f"{user_file}:contains_answer")], ["p"] * 3, ["a", "b", "c"],
              [[1], [2], [3]], {"answer": ["a", "b"]})


def test_the_shipped_rewards_agree_with_trl_where_trl_reads_the_answer() -> None:
    """math_answer against TRL's accuracy_reward on LaTeX answers (both math-verify), plain numbers beside them
    (which TRL's LaTeX-only extraction does not read); think_format against TRL's think_format_reward."""
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward, think_format_reward

    from llama_megatron.data.reward_functions import first_number_answer, math_answer, think_format

    latex = [r"So it is \boxed{\frac{1}{2}}.", r"The answer is $0.5$", r"\boxed{3}", "none"]
    gold = [r"\frac{1}{2}", "0.5", "4", "7"]
    messages = [[{"role": "assistant", "content": text}] for text in latex]
    assert math_answer(messages, gold) == accuracy_reward(messages, gold) == [1.0, 1.0, 0.0, 0.0]
    # an answer without an anchor (no box, no "the answer is"): TRL's reads none, ours the last expression
    unanchored = [[{"role": "assistant", "content": r"I get $\frac{2}{4}$"}]]
    assert (math_answer(unanchored, [r"\frac{1}{2}"]), accuracy_reward(unanchored, [r"\frac{1}{2}"])) == ([1.0], [0.0])
    assert math_answer(["12", "so 7 + 5 = 12", "13", "twelve"], ["12"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert math_answer(["5"], ["(unparseable) !!"]) == [None]  # a gold answer it cannot read scores nothing
    assert first_number_answer(["7 or 12", "12.0 at last", "none", [{"content": "-3, 4"}]], ["7", "12", "1", "-3"]) \
        == [1.0, 1.0, 0.0, 1.0]
    texts = ["<think>\nwhy\n</think>\n42", "<think>a</think><think>b</think>c", "42", "<think>open", " <think>x</think>"]
    assert think_format([[{"content": t}] for t in texts]) == think_format_reward([[{"content": t}] for t in texts])
    assert think_format(texts) == [1.0, 0.0, 0.0, 0.0, 0.0]
