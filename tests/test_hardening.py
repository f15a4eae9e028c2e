"""The hardening of issue 41, each fault injected in-process (no launches): planted symlinks, a clock that runs
behind, a file system without flock, what killed writers leave, a hostile store client, hostile templates, deeply
nested lines, malformed checkpoints."""

from __future__ import annotations

import errno
import os
import re
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from launch_utils import ROOT

from llama_megatron.checkpoint.atomic import atomic_output_dir, check_output, write_text_atomic
from llama_megatron.checkpoint.meta import LATEST_FILE, CheckpointMeta, saved_tags
from llama_megatron.errors import CheckpointError, ConfigError, SaveFailed
from llama_megatron.training import checkpointing as ckpt
from llama_megatron.training.config import CheckpointConfig

ONE = SimpleNamespace(rank=0, world_size=1)


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


# ---- symlinks ----

def test_overwrite_through_a_symlink_to_the_input_is_refused(tmp_path) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "w").write_text("keep")
    (tmp_path / "out").symlink_to(src)
    with pytest.raises(CheckpointError, match="overlaps the input"):
        check_output(str(tmp_path / "out"), True, inputs=(str(src),))
    (tmp_path / "inner").symlink_to(src / "sub", target_is_directory=True)
    with pytest.raises(CheckpointError, match="overlaps the input"):
        check_output(str(tmp_path / "inner"), True, inputs=(str(src),))
    assert (src / "w").read_text() == "keep"


def test_temp_names_are_not_followed(tmp_path) -> None:
    """A link planted where the temp file of ``latest`` used to be (``latest.tmp.<pid>``), and one planted as the
    save dir's ``.lock``: neither target is written."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / f"{LATEST_FILE}.tmp.{os.getpid()}").symlink_to(victim)
    write_text_atomic(str(tmp_path / LATEST_FILE), "global_step5")
    assert (tmp_path / LATEST_FILE).read_text() == "global_step5"
    (tmp_path / ".lock").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"\.lock is a symbolic link"):
        ckpt.SaveDirLock(str(tmp_path)).acquire()
    assert victim.read_text() == "precious"
    assert oct(os.stat(tmp_path / LATEST_FILE).st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- retention and fallback by save order, not clock ----

def _save(save_dir, step: int, clock: float, monkeypatch, keep_last: int = 2) -> None:
    """One save through the real finish path (manifest, rename, latest, retention) with the wall clock at
    ``clock``."""
    tmp = save_dir / f".tmp-global_step{step}"
    tmp.mkdir(parents=True)
    (tmp / "mp_rank_00_model_states.pt").write_bytes(os.urandom(64))
    meta = CheckpointMeta(step=step, consumed_samples=step, tensor=1, pipeline=1, data_parallel=1, zero_stage=0,
                          model={}, padded_vocab_size=128)
    monkeypatch.setattr(ckpt.time, "time", lambda: clock)
    ckpt.PendingSave(f"global_step{step}", str(save_dir), str(tmp), str(save_dir / f"global_step{step}"), meta,
                     keep_last, ONE, None).finish([{}])


def test_retention_and_fallback_ignore_a_clock_that_runs_behind(tmp_path, monkeypatch) -> None:
    """The node saving step 1100 has a clock an hour behind the one that saved 1000: retention still keeps 1100
    and the fallback still prefers it."""
    save_dir = tmp_path / "ckpt"
    _save(save_dir, 900, 1e9, monkeypatch)
    _save(save_dir, 1000, 1e9 + 100, monkeypatch)
    _save(save_dir, 1100, 1e9 + 200 - 3600, monkeypatch)
    assert saved_tags(str(save_dir)) == ["global_step1100", "global_step1000"]
    (save_dir / LATEST_FILE).write_text("global_step7")  # names a tag that is gone: fall back
    meta, notes = ckpt.choose_tag(str(save_dir), None, fallback=True)
    assert meta.tag == "global_step1100" and meta.save_index == 2
    # a rollback: resumed from 1000, the next save (1050) is the newest although its step is lower
    _save(save_dir, 1050, 0.0, monkeypatch)
    assert saved_tags(str(save_dir)) == ["global_step1050", "global_step1100"]


# ---- the save dir's lock where flock fails ----

def _no_flock(monkeypatch) -> None:
    def refuse(fh, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(ckpt.fcntl, "flock", refuse)


def test_without_flock_a_heartbeat_lock_file_owns_the_dir(tmp_path, monkeypatch) -> None:
    _no_flock(monkeypatch)
    monkeypatch.setattr(ckpt.SaveDirLock, "HEARTBEAT_S", 0.05)
    first = ckpt.SaveDirLock(str(tmp_path))
    assert first.acquire() is None
    assert "refuses flock (ENOLCK)" in first.note and ".lock.owner" in first.note
    owner = tmp_path / ".lock.owner"
    os.utime(owner, (1.0, 1.0))
    deadline = time.monotonic() + 10
    while os.stat(owner).st_mtime < 2.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.stat(owner).st_mtime > 2.0  # the heartbeat touched it
    holder = ckpt.SaveDirLock(str(tmp_path)).acquire()
    assert holder.startswith(f"pid {os.getpid()} on host ") and "heartbeat" in holder
    first.release()
    assert not owner.exists()
    # a killed holder's file (no heartbeat for longer than STALE_S) is taken over
    owner.write_text("pid 1 on host gone since then\n")
    os.utime(owner, (1.0, 1.0))
    second = ckpt.SaveDirLock(str(tmp_path))
    assert second.acquire() is None
    assert owner.read_text().startswith(f"pid {os.getpid()} ")
    second.release()


def test_take_save_dir_says_how_it_owns_the_dir_and_reclaims_temps(tmp_path, monkeypatch) -> None:
    """One line where flock fails; what killed saves left (SIGKILL: nothing ran) is removed once the run owns the
    dir, the checkpoints kept."""
    _no_flock(monkeypatch)
    save = tmp_path / "ckpt"
    for name in (".tmp-global_step5", ".old-global_step3-4194304", "global_step2"):
        (save / name).mkdir(parents=True)
    (save / "global_step2" / "llama_megatron.json").write_text("{}")
    (save / f"{LATEST_FILE}.tmp.77").write_text("global_step5")
    (save / f"{LATEST_FILE}.tmp.77.x1y2").write_text("global_step5")
    lines: list[str] = []
    lock = ckpt.take_save_dir(CheckpointConfig(save=str(save)), str(save), ONE, SimpleNamespace(info=lines.append))
    try:
        assert sorted(os.listdir(save)) == [".lock", ".lock.owner", "global_step2"]
        assert lines[0].startswith(f"note: checkpoint.save {save}: the file system refuses flock (ENOLCK)")
        assert lines[1].startswith(f"removed what killed saves left in {save}: .old-global_step3-4194304, .tmp-")
    finally:
        lock.release()


def test_a_killed_conversion_temp_is_reclaimed(tmp_path) -> None:
    """``.tmp-<out>-<pid>`` of a writer that is gone goes; a live writer's stays."""
    dead, live = tmp_path / ".tmp-out-4194304", tmp_path / f".tmp-out-{os.getppid()}"
    dead.mkdir()
    live.mkdir()
    with atomic_output_dir(str(tmp_path / "out"), overwrite=False) as tmp:
        open(os.path.join(tmp, "f"), "w").close()
    assert sorted(os.listdir(tmp_path)) == [live.name, "out"]


def test_a_killed_preprocess_temps_are_reclaimed(tmp_path) -> None:
    """``PREFIX.bin.tmp-<pid>`` and the index spools of a preprocess that is gone go when the prefix is written
    again; another prefix's, and a live writer's, stay."""
    import numpy as np

    from llama_megatron.data.indexed_dataset import IndexedDatasetWriter

    dead = ["o.bin.tmp-4194304", "o.idx.tmp-4194304", "o.idx.tmp-4194304.sizes", "o.idx.tmp-4194304.docs"]
    kept = [f"o.bin.tmp-{os.getppid()}", "other.bin.tmp-4194304"]
    for name in dead + kept:
        (tmp_path / name).write_bytes(b"x")
    with IndexedDatasetWriter(str(tmp_path / "o"), np.uint16) as writer:
        writer.add_document([1, 2, 3])
        writer.finalize()
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["o.bin", "o.idx"])


# ---- the watchdog's store ----

@pytest.fixture
def job_store():
    """Rank 0's store server as a 2-rank job on one host serves it (127.0.0.1, a free port)."""
    from llama_megatron.parallel.launch import Placement, free_port, serve_job_store

    address = ("127.0.0.1", free_port())
    return address, serve_job_store(address, Placement(0, 2, 0, 2), 10.0)


def test_the_job_store_listens_on_the_master_address_only(job_store) -> None:
    import psutil

    (host, port), store = job_store
    listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening == [(host, port)]  # torch's own server: ('0.0.0.0', port) / ('::', port)
    store.set("k", "v")


def _watching(monkeypatch, address, nonce: str, world_size: int = 2):
    """A watchdog for rank 0 with a 1.2 s timeout whose exit is recorded instead of taken."""
    from llama_megatron.training.faults import watchdog

    exits: list[int] = []
    ended = threading.Event()
    dogs = []

    def record(code: int) -> None:
        exits.append(code)
        ended.set()
        dogs[0]._stop.set()  # its thread ends, as the real exit would end the process

    monkeypatch.setattr(watchdog.os, "_exit", record)
    dogs.append(watchdog.StallWatchdog(0.02, 0, world_size, (0, 1), address, nonce))
    return dogs[0], exits, ended


def test_a_client_writing_the_store_cannot_end_the_job(job_store, monkeypatch, capfd) -> None:
    """Anyone reaching the port may write; without the job's nonce its keys are not ours, and a value that names
    no rank is no stall. The nonce's own key (a real stall on rank 1) still ends the rank: the test is live."""
    from llama_megatron.parallel.launch import RendezvousStore

    address, _ = job_store
    dog, exits, ended = _watching(monkeypatch, address, "n0nce")
    intruder = RendezvousStore(address, 5.0)
    for key in ("llama_megatron/stalled", "llama_megatron//stalled", "llama_megatron/guess/stalled"):
        intruder.set(key, "1")
    deadline = time.monotonic() + 1.6
    while time.monotonic() < deadline:
        dog.beat(1, "stepping")
        time.sleep(0.1)
    assert exits == []
    intruder.set("llama_megatron/n0nce/stalled", "7")  # names no rank of a 2-rank job
    deadline = time.monotonic() + 1.1
    while time.monotonic() < deadline:
        dog.beat(1, "stepping")
        time.sleep(0.1)
    assert exits == []
    intruder.set("llama_megatron/n0nce/stalled", "1")
    dog.beat(1, "stepping")
    assert ended.wait(10) and exits == [5]
    assert "ending with rank 1, which reached the timeout first" in capfd.readouterr().err
    dog.close()


def test_a_malformed_progress_entry_does_not_stop_the_watchdog(job_store, monkeypatch, capfd) -> None:
    """``{}`` under rank 1's key used to raise KeyError in the thread, and this rank then hung forever."""
    from llama_megatron.parallel.launch import RendezvousStore

    address, _ = job_store
    RendezvousStore(address, 5.0).set("llama_megatron/n0nce/progress/1", "{}")
    dog, exits, ended = _watching(monkeypatch, address, "n0nce")
    assert ended.wait(15) and exits == [5]  # no beat: this rank's own timeout
    err = capfd.readouterr().err
    assert "stalled at step 0 (starting) on rank 0" in err
    assert "rank 1 (its progress entry is not one of ours: b'{}')" in err
    dog.close()


# ---- template output limits ----

@pytest.mark.parametrize("template, message", [
    ("{{ '%0200000000d' % 0 }}", "formats a field of 200000000 characters"),
    ("{{ '%*d' % (200000000, 0) }}", "formats a field of 200000000 characters"),
    ("{{ '%0200000000d'|format(0) }}", "formats a field of 200000000 characters"),
    ("{{ '{:>200000000}'.format('x') }}", "formats a field of 200000000 characters"),
    ("{{ 'x'|center(200000000) }}", "pads a string to a width of 200000000 characters"),
    ("{{ 'x'.rjust(200000000) }}", "pads a string to a width of 200000000 characters"),
    ("{{ (['x' * 16000000] * 13)|join }}", "joins a string of 208000000 characters"),
    ("{{ ''.join(['x' * 16000000] * 13) }}", "joins a string of 208000000 characters"),
    ("{{ ('x\\n' * 2000000)|indent(13) }}", "indents a string of 30000013 characters"),
    ("{{ ('x' * 1000).replace('', 'y' * 100000) }}", "replaces into a string of 100101000 characters"),
], ids=["percent", "percent-star", "format-filter", "str-format", "center", "rjust", "join-filter", "str-join",
        "indent", "replace"])
def test_template_payloads_are_bounded_before_they_allocate(template, message, tmp_path) -> None:
    """Each payload used to render 1e8-2e8 characters before the output bound saw them; now refused before the
    value is built (the peak allocation stays far below it)."""
    import tracemalloc

    from llama_megatron.data.chat_template import ChatEncoder, TemplateRenderError

    jinja = tmp_path / "t.jinja"
    jinja.write_text(template)
    encoder = ChatEncoder(os.path.join(ROOT, "data", "tokenizer"), str(jinja))
    tracemalloc.start()
    try:
        with pytest.raises(TemplateRenderError, match=re.escape(message)):
            encoder.render([{"role": "user", "content": "a"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MiB allocated"


def test_bounded_templates_still_render(tmp_path) -> None:
    """The checks refuse only what is over the bound: ordinary uses of the same filters and methods render."""
    from llama_megatron.data.chat_template import ChatEncoder

    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ '%03d' % 7 }}|{{ 'ab'|center(6) }}|{{ ['a', 'b']|join(',') }}|{{ '{:>4}'.format('z') }}|"
                     "{{ 'x'|indent(2, true) }}|{{ 'aXa'.replace('X', '-') }}|{{ '%s=%d'|format('n', 2) }}")
    encoder = ChatEncoder(os.path.join(ROOT, "data", "tokenizer"), str(jinja))
    assert encoder.render([{"role": "user", "content": "a"}]) == "007|  ab  |a,b|   z|  x|a-a|n=2"


def test_a_listing_that_disagrees_with_the_hashed_files_fails_the_save(tmp_path, monkeypatch) -> None:
    """Rank 0's listing (a stale NFS directory cache) lacks a file another rank wrote and hashed: the save fails
    with one line instead of publishing a manifest that does not describe the tag; latest is untouched."""
    save_dir = tmp_path / "ckpt"
    _save(save_dir, 1, 1e9, monkeypatch)
    real = ckpt.tag_files
    monkeypatch.setattr(ckpt, "tag_files", lambda d: [n for n in real(d) if not n.startswith("zero_pp_rank_1")])
    tmp = save_dir / ".tmp-global_step2"
    tmp.mkdir()
    (tmp / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x" * 10)
    share = {"zero_pp_rank_1_mp_rank_00_optim_states.pt": {"size": 10, "sha256": "0" * 64}}
    meta = CheckpointMeta(step=2, consumed_samples=2, tensor=1, pipeline=1, data_parallel=1, zero_stage=0,
                          model={}, padded_vocab_size=128)
    with pytest.raises(SaveFailed, match="lacks zero_pp_rank_1_mp_rank_00_optim_states.pt, which the ranks wrote"):
        ckpt.PendingSave("global_step2", str(save_dir), str(tmp), str(save_dir / "global_step2"), meta, 0, ONE,
                         None).finish([share])
    assert (save_dir / LATEST_FILE).read_text() == "global_step1" and not tmp.exists()


# ---- beats through a long save and evaluation ----

def test_a_save_longer_than_the_timeout_beats_as_it_goes(tmp_path, monkeypatch, capfd) -> None:
    """1.2 s timeout: a save that writes for 3 s (no beat from the main thread, as inside DeepSpeed's torch.save
    or a barrier while another rank writes) and hashes for 2 s keeps the rank alive; once its files stop
    growing and nothing beats, the rank ends (exit 5): the watch is live."""
    from llama_megatron.checkpoint.manifest import file_digest

    dog, exits, ended = _watching(monkeypatch, None, "", world_size=1)
    writing = tmp_path / ".tmp-global_step9"
    writing.mkdir()
    with dog.working(9, "checkpoint save", str(writing)) as progress:
        for _ in range(10):  # another rank's shard growing on the shared file system
            with open(writing / "layer_01-model_00-model_states.pt", "ab") as fh:
                fh.write(b"x" * 1000)
            time.sleep(0.3)
        assert exits == []
        shard = tmp_path / "shard"
        shard.write_bytes(b"y" * (1 << 24) * 2)
        calls = []

        def slow_beat() -> None:  # hashing 32 MiB: two chunks, 1 s each
            calls.append(1)
            progress()
            time.sleep(1.0)

        file_digest(str(shard), progress=slow_beat)
        assert calls == [1, 1] and exits == []
        assert ended.wait(10) and exits == [5]  # nothing grows, nothing beats
    assert "stalled at step 9 (checkpoint save) on rank 0" in capfd.readouterr().err
    dog.close()


def _listening(port: int) -> list:
    import psutil

    return [tuple(c.laddr) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_under_torchrun_the_watchdog_store_listens_on_the_master_address_only(monkeypatch) -> None:
    """torchrun's agent serves MASTER_ADDR:MASTER_PORT on every interface: rank 0 serves the watchdog a store of
    its own on MASTER_ADDR only (a port the kernel picks), which the ranks reach."""
    from llama_megatron.parallel.launch import RendezvousStore, free_port
    from llama_megatron.training.faults.watchdog import job_store

    agent_port = free_port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent_port), "TORCHELASTIC_RUN_ID": "job",
                       "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    (host, port), nonce = job_store(0.5)
    assert host == "127.0.0.1" and port != agent_port and len(nonce) == 32
    assert _listening(port) == [("127.0.0.1", port)]
    client = RendezvousStore((host, port), 5.0)
    client.set(f"llama_megatron/{nonce}/progress/1", "x")
    assert client.get(f"llama_megatron/{nonce}/progress/1") == b"x"
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # the deepspeed launcher: init_distributed's store
    assert job_store(0.5)[0] == ("127.0.0.1", agent_port)


def test_a_loopback_master_address_is_listened_on_in_a_job_spanning_nodes(monkeypatch) -> None:
    """127.0.0.1, ::1 and localhost are loopback on every node: only this host's ranks can reach them, so rank 0
    listens there whatever the job's size. A name this host alone maps to loopback (Debian's /etc/hosts: its own
    name -> 127.0.1.1) is the real address on the other nodes: across nodes it keeps every interface."""
    from llama_megatron.parallel.launch import Placement, _listen_host, free_port, serve_job_store

    two_nodes = Placement(0, 4, 0, 2)
    assert _listen_host("127.0.0.1", 1, two_nodes) == "127.0.0.1"
    assert _listen_host("::1", 1, two_nodes) == "::1"
    assert _listen_host("localhost", 1, two_nodes) in ("127.0.0.1", "::1")
    port = free_port()
    serve_job_store(("127.0.0.1", port), two_nodes, 10.0).set("k", "v")
    assert _listening(port) == [("127.0.0.1", port)]
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real(
        "127.0.1.1" if host == "node0" else host, *a, **k))
    assert _listen_host("node0", 1, two_nodes) is None
    assert _listen_host("node0", 1, Placement(0, 2, 0, 2)) == "127.0.1.1"  # one node: every rank is here


# ---- what killed writers leave, and beats, in SFT and preference runs ----

def test_a_killed_sft_preprocess_meta_temp_is_reclaimed(tmp_path) -> None:
    """``PREFIX_sft.json.tmp-<pid>`` of a preprocess-sft that is gone goes when the prefix is written again, as
    the shards' temps do; a live writer's stays."""
    import json

    from llama_megatron.data.sft_preprocess import preprocess_sft

    dead, live = "o_sft.json.tmp-4194304", f"o_sft.json.tmp-{os.getppid()}"
    for name in (dead, live, "o_tokens.bin.tmp-4194304"):
        (tmp_path / name).write_text("{")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    preprocess_sft([str(src)], os.path.join(ROOT, "data", "tokenizer"), str(tmp_path / "o"), quiet=True)
    assert sorted(os.listdir(tmp_path)) == sorted(["in.jsonl", live, "o_sft.json", "o_tokens.bin", "o_tokens.idx",
                                                   "o_mask.bin", "o_mask.idx"])


def test_a_killed_reference_table_temp_is_reclaimed(tmp_path) -> None:
    """The table's temp carries the host and pid: a dead writer's on this host goes, a live one's and another
    host's (a cache directory shared across nodes) stay."""
    import numpy as np

    from llama_megatron.training.run.reference import store_table

    host = socket.gethostname()
    kept = [f"ab12.npy.tmp-{host}-{os.getppid()}", "ab12.npy.tmp-elsewhere-4194304"]
    for name in [f"ab12.npy.tmp-{host}-4194304", f"cd34.npy.tmp-{host}-4194304", *kept]:
        (tmp_path / name).write_bytes(b"x")
    store_table(str(tmp_path / "ef56.npy"), np.ones((3, 2)))
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "ef56.npy"])
    assert np.load(tmp_path / "ef56.npy").tolist() == [[1.0, 1.0]] * 3


def test_the_reference_pass_beats_as_it_goes(tmp_path, monkeypatch, capfd) -> None:
    """1.2 s timeout: a reference pass of 8 forwards of 0.25 s each (2 s) keeps the rank alive (without the
    beats its line comes at 1.5 s), watched as "the reference log-probabilities"."""
    import torch

    from llama_megatron.training.run import reference

    seen = []

    class Engine:
        model = torch.nn.Linear(1, 1)
        model.loss_fn = SimpleNamespace(sequence_log_probs=None)
        reference_logps = None

        def holds_loss(self) -> bool:
            return True

        def eval_loss(self, micro_batches, progress) -> None:
            for mb in micro_batches:
                progress()  # as the engine's forward pre-hook calls it
                seen.append((dog.step, dog.doing))
                time.sleep(0.25)
                self.model.loss_fn.sequence_log_probs.append(torch.zeros(2 * len(mb.pair_ids)))

    class Pairs(list):
        stats = {"rows_per_epoch": 16}

    monkeypatch.setattr(reference, "step_batches", lambda rows, config, pctx, start, steps: (
        [SimpleNamespace(pair_ids=torch.tensor([2 * s, 2 * s + 1]))] for s in range(steps)))
    monkeypatch.setattr(reference, "reference_key", lambda session: "ab12")
    monkeypatch.setattr(reference, "_table_path", lambda session, key: str(tmp_path / f"{key}.npy"))
    config = SimpleNamespace(data=SimpleNamespace(pair_count=lambda: 16), batch=SimpleNamespace(global_batch_size=2),
                             checkpoint=SimpleNamespace(finetune=False, save=None))
    session = SimpleNamespace(config=config, engine=Engine(), pctx=SimpleNamespace(rank=0, tp_rank=0, cp_rank=0),
                              pre=SimpleNamespace(checkpoint=None), step=7)
    dog, exits, ended = _watching(monkeypatch, None, "", world_size=1)
    reference.prepare_reference(session, [Pairs(range(16))], SimpleNamespace(info=lambda line: None), watchdog=dog)
    assert "stalled" not in capfd.readouterr().err and exits == []
    assert seen == [(7, "the reference log-probabilities")] * 8 and session.engine.reference_logps.shape == (16, 2)
    dog.close()
