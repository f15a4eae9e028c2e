"""The job's key-value store at MASTER_ADDR:MASTER_PORT: rank 0 serves it on MASTER_ADDR only (and on a free port
when the launcher's is taken by another job on this host), and every rank reaches it with requests bounded in time
(the stall watchdog's progress, the universal conversion's handshake) beside the process groups."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading
import time

from llama_megatron import host_sockets
from llama_megatron.errors import ConfigError
from llama_megatron.parallel.placement import Placement, placement


def rendezvous_address() -> tuple[str, int] | None:
    """MASTER_ADDR:MASTER_PORT, where every launcher keeps the job's key-value store (None without one)."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


class RendezvousStore:
    """A client of the job's key-value store (the rendezvous at MASTER_ADDR:MASTER_PORT, served by rank 0 under
    the deepspeed launcher and by the agent under torchrun): ranks publish progress there beside the process
    groups, so a stalled collective cannot hide it.

    Every request (the connection too) ends within ``timeout_s``, raising ``TimeoutError`` otherwise: a TCPStore
    request to a server that is alive but stopped (SIGSTOP, a paused host) waits forever whatever the store's own
    timeout, so each runs in a daemon thread that is abandoned when it does not answer. A store that did not answer
    once is not asked again (its connection may hold the unanswered request): every later request raises too."""

    def __init__(self, address: tuple[str, int], timeout_s: float) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._store = None
        self._failed: BaseException | None = None

    def set(self, key: str, value: str) -> None:
        self._call(lambda store: store.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda store: store.get(key))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda store: store.check(keys))

    def _connect(self):
        import datetime

        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(self.address[0], self.address[1], is_master=False, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._store

    def _call(self, request):
        import threading

        if self._failed is not None:
            raise TimeoutError(f"the store at {self.address[0]}:{self.address[1]} did not answer before")
        result: list = []

        def run() -> None:
            try:
                result.append((True, request(self._connect())))
            except Exception as error:  # noqa: BLE001 - handed to the caller
                result.append((False, error))

        thread = threading.Thread(target=run, name="rendezvous-store", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not result:
            self._failed = TimeoutError(f"the store at {self.address[0]}:{self.address[1]} did not answer within "
                                        f"{self.timeout_s:g} s")
            raise self._failed
        ok, value = result[0]
        if not ok:
            raise value
        return value


def _alike_on_every_node(host: str) -> bool:
    """Whether every node resolves ``host`` to the same address: an IP address, or localhost (RFC 6761: loopback
    everywhere)."""
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _listen_host(host: str, port: int, where: Placement) -> str | None:
    """The address rank 0's store listens on: MASTER_ADDR as this host resolves it. None (every interface,
    torch's default) for a wildcard, a name that does not resolve, or a name that resolves to loopback here in a
    job spanning nodes (some /etc/hosts map a host's own name to 127.0.1.1 locally, which the other nodes resolve to
    the real address). A loopback address given as such (127.0.0.1, ::1, localhost) is loopback on every node: only
    this host's ranks can reach it, so the store listens there whatever the job's size."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, IndexError):
        return None
    ip = sockaddr[0]
    if ip in ("0.0.0.0", "::"):
        return None
    if ipaddress.ip_address(ip).is_loopback and where.nodes > 1 and not _alike_on_every_node(host):
        return None
    return ip


_SERVERS: list = []  # the job store's server and its listening socket: alive as long as the process


def serve_job_store(address: tuple[str, int], where: Placement, timeout_s: float):
    """Rank 0's server of a store of the job (the rendezvous at MASTER_ADDR:MASTER_PORT, or with port 0 one on a
    port the kernel picks: ``.port`` says which), listening on MASTER_ADDR only: torch's own listens on every
    interface, where any host that reaches the port may read and write the job's keys without authentication.
    None where the address gives no safe interface (:func:`_listen_host`): torch then serves it as before."""
    import datetime

    import torch.distributed as dist

    host = _listen_host(address[0], address[1], where)
    if host is None:
        return None
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
    try:
        sock.bind((host, address[1]))
        sock.listen(max(128, where.world_size))
        store = dist.TCPStore(address[0], sock.getsockname()[1], where.world_size, is_master=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    _SERVERS.append((store, sock))
    return store


def _port_moves(where: Placement) -> bool:
    """Whether rank 0 may serve the rendezvous on another port than the launcher's, telling the other ranks
    (:func:`settle_job_store`): every rank is a child of one deepspeed launcher on this host, so they can ask rank 0
    before any of them reaches the port (:mod:`llama_megatron.host_sockets`)."""
    return (where.launcher == "deepspeed" and where.world_size == where.local_world_size > 1
            and host_sockets.supported())


def port_in_use(address: tuple[str, int]) -> ConfigError:
    return ConfigError(f"the rendezvous port {address[1]} at {address[0]} (MASTER_ADDR:MASTER_PORT) is in use on this "
                       f"host, by another job or program: start this one with another port (deepspeed --master_port P, "
                       f"torchrun --master-port P, or MASTER_PORT=P under srun)")


def settle_job_store(address: tuple[str, int], where: Placement, timeout_s: float):
    """Rank 0: serve the job's store at ``address`` (:func:`serve_job_store`; None where torch is to serve it). When
    that port is taken (another job on this host started with the launcher's default) and every rank is this
    launcher's (:func:`_port_moves`), rank 0 serves on a free port instead, says so in one line, and answers each
    other rank's question for the port; elsewhere a taken port is one line (:class:`ConfigError`). The other ranks
    of such a launch ask rank 0 before they touch the port (they never reach the other job's store), then go on with
    MASTER_PORT set to its answer; they return None."""
    moves = _port_moves(where)
    name = f"rendezvous/{host_sockets.launcher_key()}/{address[1]}"
    if where.rank != 0:
        if moves:
            os.environ["MASTER_PORT"] = _ask_port(name, timeout_s)
        return None
    try:
        server = serve_job_store(address, where, timeout_s)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        if not moves:
            raise port_in_use(address) from None
        server = serve_job_store((address[0], 0), where, timeout_s)
        print(f"port {address[1]} (MASTER_PORT) is in use on this host, by another job: this one's rendezvous is on "
              f"port {server.port}", flush=True)
        os.environ["MASTER_PORT"] = str(server.port)
    if moves:
        holder = host_sockets.claim(name)
        if holder is not None:
            _SERVERS.append(holder)
            threading.Thread(target=host_sockets.answer, name="rendezvous-port", daemon=True,
                             args=(holder, os.environ["MASTER_PORT"].encode(), where.world_size - 1,
                                   timeout_s)).start()
    return server


def _ask_port(name: str, timeout_s: float) -> str:
    """Rank 0's answer to :func:`settle_job_store`'s question, asked until it comes (rank 0 may still be importing);
    past ``timeout_s`` one line."""
    deadline = time.monotonic() + timeout_s
    while (port := host_sockets.ask(name)) is None:
        if time.monotonic() > deadline:
            raise ConfigError(f"rank 0 of this launch did not say its rendezvous port within {timeout_s:g} s")
        time.sleep(0.05)
    return port.decode()


def progress_store_address(timeout_s: float) -> tuple[str, int] | None:
    """Where the ranks publish their progress (the stall watchdog), as rank 0 sees it: MASTER_ADDR:MASTER_PORT,
    whose store rank 0 serves on MASTER_ADDR only (:func:`init_distributed`); under torchrun, whose agent serves
    that one on every interface, a store of its own on MASTER_ADDR only (a port the kernel picks), unless
    MASTER_ADDR gives no safe interface (:func:`_listen_host`: the agent's then). The other ranks learn it from
    rank 0 over the process group."""
    address = rendezvous_address()
    where = placement()
    if address is None or where.world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return address
    try:
        server = serve_job_store((address[0], 0), where, timeout_s)
    except OSError:  # MASTER_ADDR is no address of this host (a --master-addr that names another node)
        server = None
    return address if server is None else (address[0], server.port)


def rendezvous_store(timeout_s: float, address: tuple[str, int] | None = None) -> RendezvousStore | None:
    """The job's store with requests bounded by ``timeout_s`` (:class:`RendezvousStore`); None without a rendezvous
    address (``address`` overrides MASTER_ADDR:MASTER_PORT)."""
    address = address or rendezvous_address()
    return None if address is None else RendezvousStore(address, timeout_s)
