"""No checkpoint file is unpickled beyond tensors and plain data, on any path that opens one.

Real training checkpoints (TP1-PP2 and TP1-DP2, ZeRO-1, plus the DP2 one's universal checkpoint) are copied and one
file of the copy gets a pickled object whose ``__reduce__`` runs a shell command creating a marker file. For each
kind of file (model states, ZeRO optimizer partition, universal-checkpoint file) and each command that reads
checkpoints (resume, fine-tune, export, reshard): one ``error: refused FILE: ...`` line naming the file and the
pickled callable, exit code 2, no output, and the marker never appears. DeepSpeed's engines, driven past our
pre-check, refuse the same files (their checkpoint engine reads through our loader), and a clean copy still loads.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from dist_utils import run_distributed
from launch_utils import PRETRAIN_CONFIG, ROOT, launch_many, run_command, train_args
from model_utils import hf_model, tiny_config
from test_checkpoint_convert_roundtrip import save_hf_bin, save_meta

from llama_megatron import train
from llama_megatron.checkpoint.manifest import MANIFEST_FILE, file_digest, read_manifest, write_manifest
from llama_megatron.checkpoint.safe_load import load_file, verify_checkpoint_dir
from llama_megatron.checkpoint.universal.conversion import ensure_universal
from llama_megatron.cli import main as cli
from llama_megatron.errors import CheckpointError

CONFIG = PRETRAIN_CONFIG
COMMON = ['data={"type": "synthetic"}', "tokenizer=null", "train.steps=2",
          "deepspeed_config=ds_configs/zero1_fp32.json"]
LAYOUTS = {"pp2": ["parallel.pipeline=2"], "dp2": []}  # both 2 processes: TP1-PP2-DP1 and TP1-PP1-DP2
# kind -> (layout, tag, file inside the tag); the universal file is the first parameter's fp32 weights
KINDS = {
    "model-states": ("pp2", "global_step2", "layer_00-model_00-model_states.pt"),
    "optimizer": ("dp2", "global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    "universal": ("dp2", "global_step2_universal", "zero/0.word_embeddings.weight/fp32.pt"),
}


class Payload:
    """Unpickling this runs ``touch MARKER``: what a hostile checkpoint would do with something worse."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """layout -> a clean training save dir (step 2); the DP2 one also holds its universal checkpoint."""
    work = tmp_path_factory.mktemp("safety")
    dirs = {name: str(work / name) for name in LAYOUTS}
    runs = [[*COMMON, *extra, f"output_dir={dirs[name]}", f"checkpoint.save={dirs[name]}/ckpt",
             "checkpoint.interval=2"] for name, extra in LAYOUTS.items()]
    launch_many(2, [train_args(CONFIG, run) for run in runs], str(work / "runs.json"))
    ensure_universal(f"{dirs['dp2']}/ckpt", "global_step2", rank=0)
    return {name: f"{out}/ckpt" for name, out in dirs.items()}


def poison(path: str, marker: str, **save_kwargs) -> None:
    """Add the payload to a checkpoint file, and rewrite its tag's manifest as a forger would: the manifest guards
    against damage, the weights-only loader against hostile files (this module tests the second)."""
    state = load_file(path, mmap=False)
    state["extra"] = Payload(marker)
    torch.save(state, path, **save_kwargs)
    tag_dir = os.path.dirname(path)
    while tag_dir != os.path.dirname(tag_dir) and not os.path.isfile(os.path.join(tag_dir, MANIFEST_FILE)):
        tag_dir = os.path.dirname(tag_dir)
    files = read_manifest(tag_dir)
    if files is not None:
        name = os.path.relpath(path, tag_dir)
        files[name] = file_digest(path)
        write_manifest(tag_dir, files)


def poisoned_copy(checkpoints: dict[str, str], kind: str, tmp_path) -> tuple[str, str, str, str]:
    """(save dir, tag, poisoned file, marker) of a copy of the kind's checkpoint with one file poisoned."""
    layout, tag, name = KINDS[kind]
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(checkpoints[layout], ckpt)
    path, marker = os.path.join(ckpt, tag, name), str(tmp_path / "MARKER")
    poison(path, marker)
    return ckpt, tag, path, marker


def refusal(path: str) -> str:
    return (f"error: refused {path}: it holds a pickled posix.system, which is not a tensor or an allowed type; "
            "nothing in it was executed (checkpoint files are loaded weights-only)")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.launched
def test_the_payload_is_live(checkpoints, tmp_path) -> None:
    """The poisoned file really runs its command when loaded the way DeepSpeed's torch engine loads it."""
    _, _, path, marker = poisoned_copy(checkpoints, "optimizer", tmp_path)
    code = f"import torch; torch.load({path!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    assert os.path.exists(marker)


def _train_in_process(monkeypatch, world_size: int, overrides: list[str]) -> int:
    """``train`` as rank 0 of ``world_size`` processes would run it; refusals come before any process group."""
    for key in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return train.main(train_args(CONFIG, overrides))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("path_name", ["resume", "finetune", "export", "reshard"])
def test_poisoned_file_is_refused(path_name, kind, checkpoints, tmp_path, monkeypatch, capsys) -> None:
    ckpt, tag, path, marker = poisoned_copy(checkpoints, kind, tmp_path)
    layout = KINDS[kind][0]
    out = str(tmp_path / "out")
    monkeypatch.chdir(ROOT)
    if path_name in ("resume", "finetune"):
        overrides = [*COMMON, f"output_dir={out}", f"checkpoint.load={ckpt}"]
        if path_name == "finetune":  # weights only, any PP: one process
            overrides += ["checkpoint.finetune=true", f"checkpoint.tag={tag}"]
            world_size = 1
        elif kind == "universal":  # DP2 -> DP1 resumes through the universal checkpoint
            world_size = 1
        else:
            overrides += LAYOUTS[layout]
            world_size = 2
        rc = _train_in_process(monkeypatch, world_size, overrides)
    else:
        argv = [path_name, "--input", ckpt, "--output", out, "--tag", tag]
        if path_name == "reshard":
            argv += ["--tp", "1", "--pp", "1" if layout == "pp2" else "2", "--make-vocab-size-divisible-by", "64"]
        rc = cli(argv)
    assert rc == 2
    assert error_lines(capsys.readouterr().err) == [refusal(path)]
    assert not os.path.exists(marker)
    assert not os.path.exists(out)


@pytest.mark.parametrize("source", ["hf-bin", "hf-bin-legacy-format", "meta"])
def test_poisoned_conversion_input_is_refused(source, tmp_path, capsys) -> None:
    """The same loader reads HF ``pytorch_model*.bin`` and Meta ``consolidated.XX.pth`` (zip or pre-zip format)."""
    model = hf_model(tiny_config(num_key_value_heads=2, intermediate_size=192))
    marker, out = str(tmp_path / "MARKER"), str(tmp_path / "out")
    if source == "meta":
        params = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-5}
        src = save_meta(model, str(tmp_path / "meta"), shards=2, embedding_dim=1, params=params)
        path = os.path.join(src, "consolidated.01.pth")
        argv = ["convert", "meta-to-megatron", "--meta-dir", src, "--output", out, "--tp", "1"]
    else:
        src = save_hf_bin(model, str(tmp_path / "hf"))
        path = os.path.join(src, "pytorch_model-00002-of-00002.bin")
        argv = ["convert", "hf-to-megatron", "--hf-dir", src, "--output", out, "--tp", "1"]
    poison(path, marker, _use_new_zipfile_serialization=source != "hf-bin-legacy-format")
    assert cli(argv) == 2
    assert error_lines(capsys.readouterr().err) == [refusal(path)]
    assert not os.path.exists(marker)
    assert not os.path.exists(out)


def test_check_follows_symlinked_directories_once(tmp_path) -> None:
    """A tag whose ``zero/`` is a symlink (DeepSpeed would follow it) is checked there too; a loop ends."""
    elsewhere, tag, marker = tmp_path / "elsewhere", tmp_path / "tag", str(tmp_path / "MARKER")
    elsewhere.mkdir()
    tag.mkdir()
    torch.save({"param": torch.zeros(2), "extra": Payload(marker)}, elsewhere / "fp32.pt")
    (tag / "zero").symlink_to(elsewhere)
    (elsewhere / "back").symlink_to(tag)
    with pytest.raises(CheckpointError, match=r"refused .*/zero/fp32.pt: it holds a pickled posix.system"):
        verify_checkpoint_dir(str(tag))
    assert not os.path.exists(marker)


@pytest.mark.launched
def test_refused_under_the_launcher(checkpoints, tmp_path) -> None:
    """The issue's case: a poisoned pipeline layer file, resumed by `deepspeed --module llama_megatron.train`."""
    ckpt, _, path, marker = poisoned_copy(checkpoints, "model-states", tmp_path)
    out = str(tmp_path / "out")
    result = run_command(2, ["-m", "llama_megatron.train"],
                         train_args(CONFIG, [*COMMON, *LAYOUTS["pp2"], f"output_dir={out}", f"checkpoint.load={ckpt}"]),
                         check=False)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    errors = error_lines(result.stdout + result.stderr)
    assert errors and set(errors) == {refusal(path)}  # each rank that got that far printed the same line
    assert "Traceback" not in result.stderr
    assert not os.path.exists(marker)
    assert not os.path.exists(out)


# DeepSpeed's engines past the pre-check: every file of a kind poisoned, so every rank meets one at the same point
ENGINE_CASES = {  # name -> (layout, file-name prefix poisoned, or None for the clean control)
    "pipeline-layer-files": ("pp2", "layer_"),
    "pipeline-optimizer": ("pp2", "zero_pp_rank_"),
    "plain-model-states": ("dp2", "mp_rank_"),
    "plain-optimizer": ("dp2", "zero_pp_rank_"),
    "pipeline-clean": ("pp2", None),
    "plain-clean": ("dp2", None),
}


def _engine_worker(rank: int, world_size: int, cases: dict, out_dir: str) -> None:
    from llama_megatron.errors import CheckpointError
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.parallel.process_groups import init_distributed
    from llama_megatron.training import checkpointing as ckpt
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config
    from llama_megatron.training.engine.training_engine import TrainingEngine

    init_distributed()  # DeepSpeed's own communication backend over the gloo group
    results = {}
    for name, (layout, load_dir) in cases.items():
        config = TrainingConfig.from_file(CONFIG, [*COMMON, *LAYOUTS[layout]])
        pctx = ParallelContext.build(pipeline=config.parallel.pipeline)
        engine = TrainingEngine(config, build_deepspeed_config(config, config.deepspeed_config, world_size), pctx)
        try:
            ckpt.load_checkpoint(engine, load_dir, "global_step2")
            results[name] = "loaded"
        except CheckpointError as exc:
            results[name] = str(exc)
        del engine
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh)


@pytest.mark.launched
def test_deepspeed_engines_read_through_our_loader(checkpoints, tmp_path, monkeypatch) -> None:
    marker = str(tmp_path / "MARKER")
    cases = {}
    for name, (layout, prefix) in ENGINE_CASES.items():
        ckpt = str(tmp_path / name)
        shutil.copytree(checkpoints[layout], ckpt)
        tag_dir = os.path.join(ckpt, "global_step2")
        for file in os.listdir(tag_dir) if prefix else []:
            if file.startswith(prefix) and file.endswith(".pt"):
                poison(os.path.join(tag_dir, file), marker)
        cases[name] = (layout, ckpt)
    monkeypatch.chdir(ROOT)
    run_distributed(_engine_worker, 2, cases, str(tmp_path))
    for rank in range(2):
        results = json.load(open(tmp_path / f"rank{rank}.json", encoding="utf-8"))
        for name, (_, prefix) in ENGINE_CASES.items():
            if prefix is None:
                assert results[name] == "loaded", (rank, name, results[name])
            else:
                assert results[name].startswith(f"refused {cases[name][1]}/global_step2/{prefix}"), (rank, name,
                                                                                                     results[name])
                assert "pickled posix.system" in results[name]
    assert not os.path.exists(marker)


def _floor(requirement: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.search(r">=([\d.]+)", requirement).group(1).split("."))


def test_dependency_floors_exclude_the_vulnerable_releases() -> None:
    """torch <= 2.5.1: weights_only=True is bypassable (CVE-2025-32434); jinja2 < 3.1.6: a sandbox escape
    (CVE-2025-27516). Every untrusted file goes through one or the other."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as fh:  # (tomllib: Python >= 3.11 only)
        deps = dict(re.findall(r'^\s*"([A-Za-z0-9_-]+)(>=[^"]*)",', fh.read().split("dependencies = [")[1].split("]")[0],
                               re.M))
    assert _floor(deps["torch"]) >= (2, 6)
    assert _floor(deps["jinja2"]) >= (3, 1, 6)
