"""README's tour as a newcomer runs it: from a fresh copy of the repository (the files git tracks or would track, not
this checkout's runs/ or data/processed/), in a new shell whose environment holds nothing of ours (no virtualenv on
PATH, no OMP_NUM_THREADS), every command of the tour's block in README order, and then the whole tour again in
another new shell. Every command exits 0 both times; the second pass trains nothing: each training command finds its
run finished and says so, and the checkpoints are the first pass's.

What is checked here is the tour's commands, not what the recipes learn: in the copy, every CPU recipe's config
(``configs/**/*-cpu.json``) trains a few steps instead of its hundreds (the whole tour as shipped is some 25 minutes
on 2 cores). The recipes' outcomes are tests/test_training_recipes.py's, in one process each.

The virtualenv is this checkout's (the one ``scripts/test.sh`` made), linked into the copy: the setup a user ran once.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOUR_HEADING = "## A tour on this CPU"
EXIT_MARK = "tour-command-exit"
STEPS = 4  # each recipe's run in the copy: enough for an evaluation and a checkpoint


def tour_commands(readme: str) -> list[str]:
    """The commands of the tour's bash block, continuation lines joined, comments and blank lines dropped."""
    section = readme[readme.index(TOUR_HEADING):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").split("\n"):
        line = line.strip()
        if line and not line.startswith("#"):
            commands.append(re.sub(r"\s+", " ", line))
    return commands


def _fresh_copy(dest: str) -> None:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        source = os.path.join(ROOT, rel)
        if not os.path.isfile(source):  # deleted in the working tree, not yet in the index
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(source, os.path.join(dest, rel))
    os.symlink(os.path.join(ROOT, ".venv"), os.path.join(dest, ".venv"))


def _shorten_recipes(clone: str) -> list[str]:
    """Every CPU recipe's config in the copy trains STEPS steps, evaluates where it does (lm-eval tasks on a few
    documents) and saves at the last one; the names."""
    shortened = []
    for path in sorted(glob.glob(os.path.join(clone, "configs", "**", "*-cpu.json"), recursive=True)):
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
        config["train"]["steps"] = STEPS
        config["optimizer"]["warmup_steps"] = 1
        if config["eval"].get("interval"):  # a recipe that evaluates (GRPO's scores its rollouts instead)
            config["eval"].update(interval=STEPS, iters=1)
        if config["eval"].get("tasks"):  # the quickstart's lm-eval task: its documents a few, not 100
            config["eval"]["tasks_limit"] = 8
        config["checkpoint"]["interval"] = STEPS
        config["logging"]["interval"] = 1
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(config, fh, indent=2)
        shortened.append(os.path.relpath(path, clone))
    return shortened


def _run_tour(clone: str, commands: list[str], log: str) -> tuple[list[int], str]:
    """Every command in one new shell (``bash --norc`` with an empty environment but HOME and a system PATH), each
    followed by a line with its exit code; the codes and the whole output."""
    script = "".join(f"{command}\necho \"{EXIT_MARK} $? after $SECONDS s\"\n" for command in commands)
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    with open(log, "w", encoding="utf-8") as out:
        subprocess.run(["bash", "--noprofile", "--norc", "-c", script], cwd=clone, env=env, stdout=out,
                       stderr=subprocess.STDOUT, check=False)
    text = open(log, encoding="utf-8").read()
    return [int(code) for code in re.findall(rf"^{EXIT_MARK} (\d+) after \d+ s$", text, re.M)], text


def _checkpoint_files(run: str) -> dict[str, float]:
    return {os.path.relpath(os.path.join(folder, name), run): os.path.getmtime(os.path.join(folder, name))
            for folder, _, names in os.walk(run) for name in names}


@pytest.fixture(scope="module")
def tour(tmp_path_factory) -> dict:  # the first test that asks for it runs both tours: see its timeout
    clone = str(tmp_path_factory.mktemp("tour") / "llama_megatron")
    _fresh_copy(clone)
    assert len(_shorten_recipes(clone)) >= 6, "the tour's recipes: pretrain, MoE, long context, SFT, DPO, LoRA"
    commands = tour_commands(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read())
    first = _run_tour(clone, commands, os.path.join(clone, "..", "first.log"))
    runs = os.path.join(clone, "runs")
    trained = {name: _checkpoint_files(os.path.join(runs, name, "checkpoints")) for name in os.listdir(runs)
               if os.path.isdir(os.path.join(runs, name, "checkpoints"))}
    second = _run_tour(clone, commands, os.path.join(clone, "..", "second.log"))
    return {"clone": clone, "commands": commands, "first": first, "second": second, "trained": trained}


def _failed(commands: list[str], codes: list[int], text: str) -> str:
    failed = [f"{code}: {command}" for command, code in zip(commands, codes) if code]
    return "\n".join(failed) + "\n---\n" + text[-6000:]


@pytest.mark.timeout(3600)  # both tours (the fixture's time counts here): some 10 minutes on 2 busy cores
def test_every_command_of_the_tour_runs_twice_in_a_new_shell(tour) -> None:
    commands = tour["commands"]
    assert commands[:2] == ["bash scripts/bootstrap.sh", "source .venv/bin/activate"]
    for codes, text in (tour["first"], tour["second"]):
        assert len(codes) == len(commands), _failed(commands, codes, text)
        assert codes == [0] * len(commands), _failed(commands, codes, text)
        assert "Traceback" not in text, text[-6000:]


def test_the_second_tour_trains_nothing(tour) -> None:
    _, text = tour["second"]
    finished = re.findall(r"^nothing to train: (runs/[\w-]+)/checkpoints/global_step\d+ holds this run", text, re.M)
    # the quickstart's run, SFT, DPO, LoRA, the context extension and the mixture of experts
    assert sorted(finished) == sorted(f"runs/{name}" for name in tour["trained"]), (finished, sorted(tour["trained"]))
    runs = os.path.join(tour["clone"], "runs")
    for name, files in tour["trained"].items():
        assert _checkpoint_files(os.path.join(runs, name, "checkpoints")) == files, name
    assert "made already" in text
