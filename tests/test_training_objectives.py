"""The objective seam (llama_megatron/training/objectives.py): each training objective is one record, the run's is
the one its data selects, and no code outside the records and the data sections asks which objective runs."""

from __future__ import annotations

import os
import re

from launch_utils import ROOT

from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.objectives import GRPO, OBJECTIVES, PREFERENCE, TOKEN_LOSS, objective_of

PROMPTS = os.path.join(ROOT, "data", "grpo", "numbers.jsonl")
SFT = os.path.join(ROOT, "tests", "configs", "e2e_sft.json")
GRPO_CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_grpo.json")


def test_each_run_gets_its_datas_record() -> None:
    sft = TrainingConfig.from_file(SFT, ["data.cache_dir=unused"])
    pairs = TrainingConfig.from_file(SFT, ["data.cache_dir=unused", "data.type=preference"])
    grpo = TrainingConfig.from_file(GRPO_CONFIG, [f"data.path={PROMPTS}", 'grpo.reward_funcs=["a:b"]'])
    assert [objective_of(c) for c in (sft, pairs, grpo)] == [TOKEN_LOSS, PREFERENCE, GRPO]
    assert [c.rows_per_sample for c in (sft, pairs, grpo)] == [1, 2, 1]
    assert [o.perplexity for o in OBJECTIVES] == [True, False, False]
    assert [o.rollout for o in OBJECTIVES] == [False, False, True]
    assert TOKEN_LOSS.loss(sft, None) is None and TOKEN_LOSS.metrics is None
    assert len({o.name for o in OBJECTIVES}) == len({o.data_type for o in OBJECTIVES}) == len(OBJECTIVES)


def test_no_code_outside_the_records_asks_which_objective_runs() -> None:
    """Outside training/objectives.py (and the data sections, which are the data types) no module compares a
    data type or names one objective's data class to choose what to do."""
    asking = re.compile(r"data\.type\s*[!=]=|PreferenceData\.type|PromptData\.type|needs_reference|"
                        r"isinstance\([^)]*(PreferenceData|PromptData)")
    package = os.path.join(ROOT, "llama_megatron")
    found = []
    for folder, _, files in os.walk(package):
        for name in files:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, package)
            if not name.endswith(".py") or relative.startswith("data") or relative in (
                    os.path.join("training", "objectives.py"), os.path.join("model", "preference.py"),
                    os.path.join("model", "grpo.py")):
                continue
            with open(path, encoding="utf-8") as fh:
                found += [f"{relative}:{n}" for n, line in enumerate(fh, 1) if asking.search(line)]
    assert found == []
