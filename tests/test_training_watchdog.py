"""The stall watchdog (training/faults/watchdog.py) and the job store it reads (parallel/job_store.py), in-process:
the store listens on MASTER_ADDR only (under torchrun a store of its own; a loopback address across nodes), a
client that writes it without the job's nonce, or a malformed entry, cannot end or stop the watch, and long saves
and reference passes beat as they go while a real stall still ends the rank."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

ONE = SimpleNamespace(rank=0, world_size=1)


@pytest.fixture
def job_store():
    """Rank 0's store server as a 2-rank job on one host serves it (127.0.0.1, a free port)."""
    from llama_megatron.parallel.job_store import serve_job_store
    from llama_megatron.parallel.placement import Placement, free_port

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
    from llama_megatron.parallel.job_store import RendezvousStore

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
    from llama_megatron.parallel.job_store import RendezvousStore

    address, _ = job_store
    RendezvousStore(address, 5.0).set("llama_megatron/n0nce/progress/1", "{}")
    dog, exits, ended = _watching(monkeypatch, address, "n0nce")
    assert ended.wait(15) and exits == [5]  # no beat: this rank's own timeout
    err = capfd.readouterr().err
    assert "stalled at step 0 (starting) on rank 0" in err
    assert "rank 1 (its progress entry is not one of ours: b'{}')" in err
    dog.close()


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
    from llama_megatron.parallel.job_store import RendezvousStore
    from llama_megatron.parallel.placement import free_port
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
    from llama_megatron.parallel.job_store import _listen_host, serve_job_store
    from llama_megatron.parallel.placement import Placement, free_port

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


def test_the_reference_pass_beats_as_it_goes(tmp_path, monkeypatch, capfd) -> None:
    """1.2 s timeout: a reference pass of 8 forwards of 0.25 s each (2 s) keeps the rank alive (without the
    beats its line comes at 1.5 s), watched as "the reference log-probabilities"."""
    import torch

    from llama_megatron.training.run import reference

    seen = []

    class Engine:
        model = torch.nn.Linear(1, 1)
        model.loss_fn = SimpleNamespace(objective=SimpleNamespace(captured=None))
        reference_logps = None

        def holds_loss(self) -> bool:
            return True

        def eval_loss(self, micro_batches, progress) -> None:
            for mb in micro_batches:
                progress()  # as the engine's forward pre-hook calls it
                seen.append((dog.step, dog.doing))
                time.sleep(0.25)
                self.model.loss_fn.objective.captured.append(torch.zeros(2 * len(mb.pair_ids)))

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
