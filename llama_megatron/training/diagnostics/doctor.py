"""``llama-megatron doctor``: what a long multi-node job needs, checked on every rank in a minute, before it starts.

Under any launcher (the same one the training job will use), every rank reports and rank 0 checks:

- every rank started and reached the rendezvous (a check-in through the launcher's store, before any process group:
  a rank missing after the timeout is named, with the host its node's other ranks run on);
- the same package, torch and DeepSpeed versions and the same training config (a hash of it) everywhere;
- the data files and the tokenizer present on every rank and identical (size and a fingerprint: the first and last
  MiB hashed with the size);
- ``checkpoint.save`` (else ``output_dir``) writable by every rank and one filesystem: a file rank 0 writes is read
  back by all, and every rank's file is seen by rank 0;
- the bandwidth of an all-reduce over each TP, CP, DP and DP x CP group, and of send/recv between adjacent pipeline
  stages (bus bandwidth as nccl-tests computes it; the slowest group of each kind is reported);
- stragglers: a fixed matmul timed on every rank, ranks more than 25% slower than the median named;
- the environment that decides NCCL's transport (NCCL_* variables, InfiniBand devices, the NCCL version), which
  should agree across ranks.

A rank that stops during the checks ends them within the timeout (training/faults/watchdog.py: one line per live rank
naming the silent one, exit 5). Rank 0 prints a table and writes the same as JSON; exit 0 when every check passes,
2 with one ``error:`` line naming the failed checks otherwise.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from llama_megatron.checkpoint.atomic import write_text_atomic
from llama_megatron.data.index_cache import file_fingerprint
from llama_megatron.errors import ConfigError, Stalled, print_error
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.job_store import rendezvous_address, settle_job_store
from llama_megatron.parallel.placement import Placement
from llama_megatron.parallel.process_groups import skip_cpu_shared_memory_op
from llama_megatron.training.checkpointing import all_gather_objects
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.faults.watchdog import StallWatchdog, job_store

SLOW = 1.25  # a rank this much slower than the median at the same matmul is a straggler


@dataclass
class Check:
    name: str
    status: str  # "ok", "failed", "warning" or "info"
    detail: str
    data: dict = field(default_factory=dict)


def run_doctor(config: TrainingConfig, where: Placement, timeout_minutes: float, output: str | None) -> int:
    """The checks on this rank; rank 0 reports. Returns the exit code."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    address = rendezvous_address()
    if address is None:
        raise ConfigError("doctor needs MASTER_ADDR and MASTER_PORT (set by every launcher)")
    store = _store(where, address, timeout)
    hosts = _check_in(store, where, timeout.total_seconds())
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(where.local_rank % torch.cuda.device_count())
    skip_cpu_shared_memory_op()
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("doctor/pg", store),
                            rank=where.rank, world_size=where.world_size, timeout=timeout)
    watchdog = StallWatchdog(timeout_minutes, where.rank, where.world_size, (0, 1), *job_store(timeout_minutes))
    try:
        par = config.parallel
        pctx = ParallelContext.build(par)
        watchdog.beat(0, "gathering every rank's report")
        reports = all_gather_objects(_local_report(config, where))
        watchdog.beat(0, "the checkpoint directory check")
        fs = _filesystem(config, pctx)
        watchdog.beat(0, "the bandwidth checks")
        bandwidth = _bandwidth(pctx, cuda)
        watchdog.beat(0, "the straggler check")
        compute = all_gather_objects(_matmul_seconds(cuda))
        watchdog.beat(0, "the report")
        code = 0
        if where.rank == 0:
            checks = [_ranks_check(hosts, where), *_identity_checks(reports), fs, *bandwidth,
                      _straggler_check(compute), _nccl_check(reports)]
            code = _report(checks, reports, config, output)
        dist.barrier()
        return code
    finally:
        watchdog.close()
        dist.destroy_process_group()


# ---- the check-in: every rank present, before any process group ----
def _store(where: Placement, address: tuple[str, int], timeout: datetime.timedelta):
    # torchrun's agent already serves the store at MASTER_PORT; under other launchers rank 0 hosts it
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts_store = where.rank == 0 and not agent_store
    server = None if agent_store else settle_job_store(address, where, timeout.total_seconds())
    if server is not None:
        return server
    address = rendezvous_address()  # the port rank 0 serves (settle_job_store may have moved it)
    return dist.TCPStore(address[0], address[1], where.world_size if hosts_store else None, is_master=hosts_store,
                         wait_for_workers=False, timeout=timeout)


def _check_in(store, where: Placement, timeout_s: float) -> dict[int, str]:
    """Every rank's host, or one line naming the ranks that never arrived (exit 5 on every rank present)."""
    keys = {r: f"doctor/hello/{r}" for r in range(where.world_size)}
    hosts: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        store.set(keys[where.rank], socket.gethostname())
        while len(hosts) < where.world_size and time.monotonic() <= deadline:
            for rank, key in keys.items():
                if rank not in hosts and store.check([key]):
                    hosts[rank] = store.get(key).decode()
            time.sleep(0.2)
    except (RuntimeError, dist.DistError):
        pass  # the store went away: rank 0, which holds it, gave up on the same missing ranks
    arrived = set(hosts)
    missing = sorted(set(keys) - arrived)
    if missing:
        local = max(where.local_world_size, 1)
        named = []
        for rank in missing:
            node_hosts = sorted({hosts[r] for r in hosts if r // local == rank // local})
            node = f"node {rank // local}" + (f", host {', '.join(node_hosts)}" if node_hosts else ", no rank of it arrived")
            named.append(f"rank {rank} ({node})")
        print_error(f"doctor: {', '.join(named)} did not reach the rendezvous at {os.environ['MASTER_ADDR']}:"
                    f"{os.environ['MASTER_PORT']} within {timeout_s:.0f} s ({len(arrived)} of {where.world_size} "
                    "ranks did)")
        if where.rank == 0:
            time.sleep(5)  # rank 0 holds the store: let the others read it for their own line
        os._exit(Stalled.exit_code)
    return hosts


# ---- what each rank sees ----
def _local_report(config: TrainingConfig, where: Placement) -> dict:
    import deepspeed

    import llama_megatron

    config_json = json.dumps(config.to_dict(), sort_keys=True, default=str)
    files = list(config.data.files())
    if config.tokenizer:
        tokenizer = config.tokenizer
        # the tokenizer's files only: a subdirectory (``.cache/huggingface/`` that HF tools leave) is not one
        files += sorted(path for n in os.listdir(tokenizer) if os.path.isfile(path := os.path.join(tokenizer, n))) \
            if os.path.isdir(tokenizer) else [tokenizer]
    seen = {}
    for path in files:
        seen[path] = file_fingerprint(path) if os.path.isfile(path) else None
    nccl = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_"))}
    ib = "/sys/class/infiniband"
    return {
        "rank": where.rank, "host": socket.gethostname(), "local_rank": where.local_rank,
        "versions": {"llama_megatron": llama_megatron.__version__, "torch": torch.__version__,
                     "deepspeed": deepspeed.__version__},
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
        "files": seen,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "environment": {"variables": nccl, "infiniband": sorted(os.listdir(ib)) if os.path.isdir(ib) else [],
                        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None},
    }


def _identity_checks(reports: list[dict]) -> list[Check]:
    checks = []
    for name, key in (("versions", "versions"), ("config", "config_sha256")):
        checks.append(_same(name, [(r["rank"], r["host"], r[key] if isinstance(r[key], str) else
                                    json.dumps(r[key], sort_keys=True)) for r in reports]))
    paths = sorted({p for r in reports for p in r["files"]})
    missing = [f"{p} on rank {r['rank']} ({r['host']})" for r in reports for p in paths if r["files"].get(p) is None]
    if missing:
        checks.append(Check("data and tokenizer files", "failed", f"missing: {'; '.join(missing[:4])}"
                            + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""), {"missing": missing}))
    else:
        differ = [p for p in paths if len({r["files"][p] for r in reports}) > 1]
        if differ:
            ranks = _odd_ones_out(reports, lambda r: tuple(r["files"][p] for p in differ))
            checks.append(Check("data and tokenizer files", "failed", f"{', '.join(differ[:3])} differ on "
                                f"{ranks} from the other ranks (size or content)", {"differ": differ}))
        else:
            checks.append(Check("data and tokenizer files", "ok", f"{len(paths)} files, the same on every rank",
                                {"files": paths}))
    return checks


def _same(name: str, values: list[tuple[int, str, str]]) -> Check:
    distinct = {v for _, _, v in values}
    if len(distinct) == 1:
        return Check(name, "ok", f"the same on every rank: {_short(values[0][2])}")
    by_value: dict[str, list[int]] = {}
    for rank, _, value in values:
        by_value.setdefault(value, []).append(rank)
    majority = max(by_value.values(), key=len)
    odd = [f"rank {rank} ({host}): {_short(value)}" for rank, host, value in values if rank not in majority]
    return Check(name, "failed", f"differs: {'; '.join(odd[:4])} (the other ranks: "
                 f"{_short(values[majority[0]][2])})", {"values": {str(r): v for r, _, v in values}})


def _short(value: str) -> str:
    return value if len(value) <= 100 else value[:16]


def _odd_ones_out(reports: list[dict], key) -> str:
    groups: dict = {}
    for r in reports:
        groups.setdefault(key(r), []).append(r)
    majority = max(groups.values(), key=len)
    odd = [f"rank {r['rank']} ({r['host']})" for r in reports if r not in majority]
    return ", ".join(odd)


def _ranks_check(hosts: dict[int, str], where: Placement) -> Check:
    nodes = sorted(set(hosts.values()))
    return Check("ranks", "ok", f"{len(hosts)} ranks reached the rendezvous, on {len(nodes)} host(s) "
                 f"({', '.join(nodes[:4])}{'...' if len(nodes) > 4 else ''}), {where.local_world_size} per node",
                 {"hosts": {str(r): h for r, h in hosts.items()}})


# ---- the checkpoint directory ----
def _filesystem(config: TrainingConfig, pctx: ParallelContext) -> Check:
    directory = config.checkpoint.save or config.output_dir
    token = all_gather_objects(uuid.uuid4().hex if pctx.rank == 0 else None)[0]
    probe = os.path.join(directory, f".doctor-{token}")
    error = None
    try:
        os.makedirs(directory, exist_ok=True)
        if pctx.rank == 0:
            write_text_atomic(probe, token)
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc.strerror or exc}"
    dist.barrier()  # entered by every rank whatever failed: a rank that skipped it would pair with the gather below
    if error is None:
        try:
            with open(probe, encoding="utf-8") as fh:
                if fh.read() != token:
                    error = "reads another file at the same path (not one filesystem)"
            mine = f"{probe}.rank{pctx.rank}"
            with open(mine, "w", encoding="utf-8") as fh:
                fh.write(token)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc.strerror or exc}"
    errors = all_gather_objects((pctx.rank, socket.gethostname(), error))
    unseen = []
    if pctx.rank == 0:
        unseen = [r for r in range(pctx.world_size) if not os.path.isfile(f"{probe}.rank{r}")]
    dist.barrier()
    for path in (f"{probe}.rank{pctx.rank}", probe if pctx.rank == 0 else None):
        if path and os.path.exists(path):
            os.remove(path)
    failed = [f"rank {r} ({h}): {e}" for r, h, e in errors if e]
    if failed:
        return Check("checkpoint directory", "failed", f"{directory}: {'; '.join(failed[:4])}")
    if unseen:
        return Check("checkpoint directory", "failed", f"{directory}: rank 0 does not see the files of ranks "
                     f"{unseen} (not one shared filesystem: every rank writes its shards, rank 0 renames the tag)")
    return Check("checkpoint directory", "ok", f"{directory}: writable by every rank, one filesystem")


# ---- bandwidth ----
def _bandwidth(pctx: ParallelContext, cuda: bool) -> list[Check]:
    device = torch.device("cuda") if cuda else torch.device("cpu")
    numel = (64 << 20) // 4 if cuda else (4 << 20) // 4
    iterations = 20 if cuda else 5
    buffer = torch.ones(numel, dtype=torch.float32, device=device)
    kinds = [("tensor", pctx.tp_size, pctx.tp_group), ("context", pctx.cp_size, pctx.cp_group),
             ("data", pctx.dp_size, pctx.dp_group), ("data x context", pctx.dp_cp_size, pctx.dp_cp_group)]
    checks = []
    for name, size, group in kinds:
        if name == "data x context" and pctx.cp_size == 1:
            continue  # the data groups again
        if size < 2 or group is None:
            continue
        seconds = _timed(lambda g=group: dist.all_reduce(buffer, group=g), iterations, cuda)
        bus = buffer.numel() * 4 * 2 * (size - 1) / size / seconds
        results = all_gather_objects((pctx.rank, bus))
        checks.append(_slowest(f"all-reduce, {name} groups of {size}", results, buffer.numel() * 4))
    if pctx.pp_size > 1:
        checks.append(_pipeline_bandwidth(pctx, buffer, iterations, cuda))
    return checks


def _pipeline_bandwidth(pctx: ParallelContext, buffer: torch.Tensor, iterations: int, cuda: bool) -> Check:
    topo = pctx.topology
    coord = topo.get_coord(pctx.rank)
    results = []
    for stage in range(pctx.pp_size - 1):
        rate = None
        dist.barrier()
        if pctx.pp_rank in (stage, stage + 1):
            peer_stage = stage + 1 if pctx.pp_rank == stage else stage
            peer = topo.get_rank(pipe=peer_stage, data=coord.data, model=coord.model)

            def exchange(peer=peer, sending=pctx.pp_rank == stage):
                (dist.send if sending else dist.recv)(buffer, peer)

            rate = buffer.numel() * 4 / _timed(exchange, iterations, cuda, barrier=False)
        results += all_gather_objects((pctx.rank, rate))
    return _slowest(f"send/recv between the {pctx.pp_size} pipeline stages",
                    [(r, rate) for r, rate in results if rate is not None], buffer.numel() * 4)


def _timed(op, iterations: int, cuda: bool, barrier: bool = True) -> float:
    op()  # warm-up: connections, NCCL communicators
    if cuda:
        torch.cuda.synchronize()
    if barrier:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        op()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iterations


def _slowest(name: str, results: list[tuple[int, float]], nbytes: int) -> Check:
    rank, rate = min(results, key=lambda item: item[1])
    median = statistics.median(r for _, r in results)
    return Check(name, "info", f"{_gbps(median)} median, slowest {_gbps(rate)} (rank {rank}); "
                 f"{nbytes >> 20} MiB messages", {"median_bytes_per_s": median, "slowest_bytes_per_s": rate,
                                                   "slowest_rank": rank})


def _gbps(rate: float) -> str:
    return f"{rate / 1e9:.2f} GB/s"


# ---- stragglers ----
def _matmul_seconds(cuda: bool) -> float:
    n, repeats, dtype = (8192, 20, torch.bfloat16) if cuda else (384, 20, torch.float32)
    device = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return _timed(lambda: torch.mm(a, b), repeats, cuda)


def _straggler_check(seconds: list[float]) -> Check:
    median = statistics.median(seconds)
    slow = [(r, s) for r, s in enumerate(seconds) if s > SLOW * median]
    data = {"median_seconds": median, "seconds": seconds}
    if slow:
        named = ", ".join(f"rank {r} ({s / median:.2f}x)" for r, s in slow)
        return Check("stragglers", "warning", f"slower than the median at the same matmul by more than "
                     f"{SLOW - 1:.0%}: {named}", data)
    worst = max(range(len(seconds)), key=seconds.__getitem__)
    return Check("stragglers", "ok", f"none: the same matmul takes {median * 1e3:.2f} ms median, "
                 f"{seconds[worst] * 1e3:.2f} ms at most (rank {worst})", data)


def _nccl_check(reports: list[dict]) -> Check:
    variants = {json.dumps(r["environment"], sort_keys=True) for r in reports}
    env = reports[0]["environment"]
    described = (", ".join(f"{k}={v}" for k, v in env["variables"].items()) or "no NCCL_*/GLOO_* variables set") + \
        (f"; InfiniBand: {', '.join(env['infiniband'])}" if env["infiniband"] else "; no InfiniBand devices") + \
        (f"; NCCL {env['nccl']}" if env["nccl"] else "")
    if len(variants) > 1:
        odd = _odd_ones_out(reports, lambda r: json.dumps(r["environment"], sort_keys=True))
        return Check("transport environment", "warning", f"differs on {odd}: {described} elsewhere",
                     {"environments": [r["environment"] for r in reports]})
    return Check("transport environment", "info", f"the same on every rank: {described}", env)


# ---- the report ----
def _report(checks: list[Check], reports: list[dict], config: TrainingConfig, output: str | None) -> int:
    width = max(len(c.name) for c in checks)
    print(f"{'check':<{width}}  {'result':<8}  detail")
    for check in checks:
        print(f"{check.name:<{width}}  {check.status:<8}  {check.detail}")
    failed = [c.name for c in checks if c.status == "failed"]
    path = output or os.path.join(config.output_dir, "doctor.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text_atomic(path, json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks], "ranks": reports},
                                       indent=2, default=str))
    print(f"doctor: {len(checks) - len(failed)} of {len(checks)} checks passed; report in {path}")
    if failed:
        sys.stdout.flush()
        print_error(f"doctor: {len(failed)} check(s) failed: {', '.join(failed)} (table above, {path})")
        return 2
    return 0
