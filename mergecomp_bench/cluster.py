"""A bandwidth-limited multi-host cluster on one Linux machine, from network namespaces.

Each "host" is a network namespace with one interface, ``eth0``, a veth pair whose other end is
attached to a bridge living in a namespace of its own (the root namespace is never touched).
Hosts get ``10.77.0.<i+1>/24``; traffic never leaves the namespaces this module creates.
A ``tbf`` qdisc limits each host's link, in both directions by default (the host's egress on
``eth0`` and its ingress, as the bridge port's egress), its bucket 10 ms of the rate (64 KiB to
1 MiB, :func:`tbf_burst`: a link idle for a while passes that much at once)::

    [ns h0: eth0 10.77.0.1] ==veth== [ns br: v0 \\
    [ns h1: eth0 10.77.0.2] ==veth== [         v1 -- bridge mcbr ]
    ...                                        ...

``procs_per_host`` workers (default 1) per host are started with ``ip netns exec`` and
torchrun's variables (``RANK``, numbered host by host; ``WORLD_SIZE``; ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``; ``GROUP_RANK``, the host; ``MASTER_ADDR`` = host 0's address,
``MASTER_PORT``) plus ``GLOO_SOCKET_IFNAME=eth0`` (gloo otherwise picks the namespace's unusable
hostname address).  The processes of one host talk through its own stack, unlimited; only
traffic between hosts crosses the limited links.
Everything is torn down on exit, failure, timeout, Ctrl-C or SIGTERM.  Needs root and iproute2
(``ip``, ``tc``); only ``tbf`` is used (no ``netem``).

Command line (everything after ``--`` is the worker command)::

    sudo python -m mergecomp_bench.cluster --hosts 2 --procs-per-host 1 --rate 1gbit --timeout 300 -- \\
        python -m mergecomp_bench --model resnet50 --compressor topk --plan auto

Python::

    with Cluster(hosts=2, rate="1gbit") as cluster:
        codes = cluster.run(["python", "worker.py"], timeout=300)
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import string
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["Cluster", "ClusterError", "main", "bits_per_second", "tbf_burst"]

SUBNET = "10.77.0"
DEFAULT_PORT = 29500
TBF_LATENCY = "20ms"
#: the tbf bucket: this much of the rate, within the two bounds (bytes)
TBF_BURST_SECONDS, TBF_BURST_MIN, TBF_BURST_MAX = 0.010, 64 * 1024, 1024 * 1024
_BITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def bits_per_second(rate: str) -> float:
    """A tc rate in bits (``"10mbit"``, ``"1gbit"``) as bits per second; ValueError for a rate
    not in bits."""
    number = rate.rstrip(string.ascii_letters)
    unit = rate[len(number):]
    try:
        return float(number) * _BITS[unit.lower()]
    except (ValueError, KeyError):
        raise ValueError(f"cluster rate must be a tc rate in bits ({', '.join(_BITS)}), got {rate!r}") from None


def tbf_burst(rate: str) -> str:
    """The tbf bucket for ``rate`` (a tc rate in bits: ``"10mbit"``, ``"1gbit"``): 10 ms of it,
    at least 64 KiB (a GSO segment passes whole) and at most 1 MiB, in bytes (``"65536b"``).  A
    link idle for long enough passes a bucket at once: 1 MiB, 0.8 s of a 10 Mbit/s link, made
    DiLoCo's 1 MB synchronizations there look three times faster than the rate allows; from
    1 Gbit/s up the bucket is 1 MiB, as it always was.  ValueError for a rate not in bits."""
    nbytes = bits_per_second(rate) / 8 * TBF_BURST_SECONDS
    return f"{int(min(TBF_BURST_MAX, max(TBF_BURST_MIN, nbytes)))}b"


class ClusterError(RuntimeError):
    """The cluster could not be set up (not root, no iproute2, a failing ip/tc command)."""


def check_privileges() -> None:
    """Raise ClusterError with a clear message unless we are root with ``ip`` and ``tc``."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise ClusterError("mergecomp_bench.cluster needs root (it creates network namespaces, veth pairs and "
                           "tc qdiscs): run it with sudo, or run the benchmark under torchrun instead")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"mergecomp_bench.cluster needs iproute2: {missing} not found on PATH")


class Cluster:
    """``hosts`` namespaces on one bridge, each link limited to ``rate`` (``None``: unlimited).

    Args:
        hosts: number of hosts, 1..250.
        rate: tc rate, e.g. ``"1gbit"``, ``"10gbit"``, ``"500mbit"``; ``None`` for no limit;
            ``"loopback"``: no namespaces at all, every worker on 127.0.0.1 (``lo``), no root needed.
        duplex: ``"both"`` limits each host's egress and ingress; ``"egress"`` only its egress.
        burst, latency: the tbf bucket size (default :func:`tbf_burst` of ``rate``) and
            queueing limit.
        port: MASTER_PORT of the workers.
        procs_per_host: workers started on each host (ranks ``host * procs_per_host + local``).
    """

    def __init__(self, hosts: int, rate: Optional[str] = None, duplex: str = "both",
                 burst: Optional[str] = None, latency: str = TBF_LATENCY, port: int = DEFAULT_PORT,
                 procs_per_host: int = 1) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be in 1..250, got {hosts}")
        if isinstance(procs_per_host, bool) or not isinstance(procs_per_host, int) or procs_per_host < 1:
            raise ValueError(f"procs_per_host must be an int >= 1, got {procs_per_host!r}")
        if duplex not in ("both", "egress"):
            raise ValueError(f"duplex must be 'both' or 'egress', got {duplex!r}")
        self.hosts = hosts
        self.procs_per_host = procs_per_host
        self.rate = rate
        self.duplex = duplex
        self.burst = burst or (tbf_burst(rate) if rate and rate != "loopback" else None)
        self.latency = latency
        self.port = port
        tag = f"mc{os.getpid()}"
        self.bridge_ns = f"{tag}br"
        self.host_ns = [f"{tag}h{i}" for i in range(hosts)]
        self._created: List[str] = []
        self._procs: List[subprocess.Popen] = []
        self._up = False
        #: the last 200 output lines of each rank of the latest run, in rank order
        self.output: List[collections.deque] = []
        self.loopback = rate == "loopback"
        if self.loopback:
            self.rate = None
            self.port = port if port != DEFAULT_PORT else _free_port()

    # -- addresses ---------------------------------------------------------------------------
    def address(self, host: int) -> str:
        return "127.0.0.1" if self.loopback else f"{SUBNET}.{host + 1}"

    @property
    def master_addr(self) -> str:
        return self.address(0)

    # -- set-up / tear-down ------------------------------------------------------------------
    def _ip(self, *args: str) -> None:
        proc = subprocess.run(list(args), capture_output=True, text=True)
        if proc.returncode != 0:
            raise ClusterError(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")

    def up(self) -> "Cluster":
        if self.loopback:
            self._up = True
            return self
        check_privileges()
        try:
            self._ip("ip", "netns", "add", self.bridge_ns)
            self._created.append(self.bridge_ns)
            br = ("ip", "-n", self.bridge_ns)
            self._ip(*br, "link", "add", "mcbr", "type", "bridge")
            self._ip(*br, "link", "set", "mcbr", "up")
            for i, ns in enumerate(self.host_ns):
                self._ip("ip", "netns", "add", ns)
                self._created.append(ns)
                host = ("ip", "-n", ns)
                self._ip(*host, "link", "set", "lo", "up")
                self._ip(*host, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}",
                         "netns", self.bridge_ns)
                self._ip(*br, "link", "set", f"v{i}", "master", "mcbr")
                self._ip(*br, "link", "set", f"v{i}", "up")
                self._ip(*host, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                self._ip(*host, "link", "set", "eth0", "up")
                if self.rate:
                    tbf = ("root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency)
                    self._ip("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf)
                    if self.duplex == "both":
                        self._ip("tc", "-n", self.bridge_ns, "qdisc", "add", "dev", f"v{i}", *tbf)
            self._up = True
            self._wait_reachable()
        except BaseException:
            self.down()
            raise
        return self

    def _wait_reachable(self, seconds: float = 10.0) -> None:
        """The bridge forwards after its ports leave the learning state: ping until it does."""
        if self.hosts < 2 or shutil.which("ping") is None:
            time.sleep(0.5)
            return
        deadline = time.monotonic() + seconds
        for i in range(1, self.hosts):
            while True:
                ok = subprocess.run(["ip", "netns", "exec", self.host_ns[i], "ping", "-c", "1", "-W", "1",
                                     self.master_addr], capture_output=True).returncode == 0
                if ok:
                    break
                if time.monotonic() > deadline:
                    raise ClusterError(f"host {i} cannot reach {self.master_addr} after {seconds:g}s")
                time.sleep(0.2)

    def down(self) -> None:
        """Kill the workers still running and delete every namespace (and so every veth)."""
        self.kill()
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created = []
        self._up = False

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- workers -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.hosts * self.procs_per_host

    def worker_env(self, rank: int, threads: Optional[int] = None) -> Dict[str, str]:
        """torchrun's variables (and gloo's interface) of rank ``rank``."""
        host, local = divmod(rank, self.procs_per_host)
        env = {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(local),
               "LOCAL_WORLD_SIZE": str(self.procs_per_host), "GROUP_RANK": str(host),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.port),
               "GLOO_SOCKET_IFNAME": "lo" if self.loopback else "eth0",
               "MERGECOMP_CLUSTER_RATE": "loopback" if self.loopback else (self.rate or "unlimited")}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        return env

    def start(self, command: Sequence[str], threads: Optional[int] = None,
              env: Optional[Dict[str, str]] = None) -> List[subprocess.Popen]:
        """Start ``command`` ``procs_per_host`` times on every host; rank 0's output passes
        through, the others' lines are prefixed ``[rank N]``."""
        if not self._up:
            raise ClusterError("the cluster is not up: use `with Cluster(...) as c:` or call up()")
        self.output = [collections.deque(maxlen=200) for _ in range(self.world_size)]
        for rank in range(self.world_size):
            full_env = {**os.environ, **(env or {}), **self.worker_env(rank, threads)}
            prefix = [] if self.loopback else ["ip", "netns", "exec", self.host_ns[rank // self.procs_per_host]]
            proc = subprocess.Popen([*prefix, *command], env=full_env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            self._procs.append(proc)
            threading.Thread(target=_pump, args=(proc, "" if rank == 0 else f"[rank {rank}] ", self.output[rank]),
                             daemon=True).start()
        return list(self._procs)

    def wait(self, timeout: Optional[float] = None) -> List[int]:
        """Wait for every worker; on timeout kill them all and report 124 for the unfinished.
        Once one worker has ended (e.g. failed, or done while a peer hangs in gloo's teardown),
        the others get a grace period, then are killed (no hangs)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        grace = None
        while True:
            codes = [p.poll() for p in self._procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if any(c is not None for c in codes) and grace is None:
                grace = now + (30.0 if any(codes) else 60.0)
            if (deadline is not None and now > deadline) or (grace is not None and now > grace):
                self.kill()
                codes = [124 if c is None else c for c in codes]
                break
            time.sleep(0.1)
        self._procs = []
        return codes

    def run(self, command: Sequence[str], timeout: Optional[float] = None, threads: Optional[int] = None,
            env: Optional[Dict[str, str]] = None) -> List[int]:
        """Start ``command`` on every host and wait; returns the exit codes in rank order."""
        self.start(command, threads, env)
        return self.wait(timeout)

    def kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(proc: subprocess.Popen, prefix: str, keep: collections.deque) -> None:
    for line in iter(proc.stdout.readline, b""):
        text = line.decode(errors="replace")
        keep.append(text.rstrip("\n"))
        sys.stdout.write(prefix + text)
        sys.stdout.flush()


def _raise_on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def install_signal_handlers() -> None:
    """SIGTERM/SIGHUP raise KeyboardInterrupt, so ``finally``/``with`` blocks tear down."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mergecomp_bench.cluster",
                                     description="Run a command on N network-namespace hosts joined by "
                                                 "bandwidth-limited links (needs root).",
                                     epilog="example: python -m mergecomp_bench.cluster --hosts 2 --rate 1gbit -- "
                                            "python -m mergecomp_bench --model resnet50")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--procs-per-host", type=int, default=1, help="workers per host (default 1)")
    parser.add_argument("--rate", default="1gbit", help="tbf rate per link, e.g. 1gbit, 10gbit; 'none' = unlimited; "
                                                        "'loopback' = no namespaces, 127.0.0.1")
    parser.add_argument("--duplex", choices=["both", "egress"], default="both")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each worker")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (default 600)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- worker command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    rate = None if args.rate.lower() in ("none", "unlimited", "0") else args.rate.lower()
    install_signal_handlers()
    try:
        with Cluster(args.hosts, rate, args.duplex, port=args.port, procs_per_host=args.procs_per_host) as cluster:
            print(f"# cluster: {args.hosts} hosts x {args.procs_per_host} processes, "
                  f"link {rate or 'unlimited'} ({args.duplex}), "
                  f"master {cluster.master_addr}:{cluster.port}", flush=True)
            codes = cluster.run(command, timeout=args.timeout, threads=args.threads)
    except ClusterError as err:
        print(f"mergecomp_bench.cluster: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mergecomp_bench.cluster: interrupted; cluster torn down", file=sys.stderr)
        return 130
    if any(codes):
        print(f"mergecomp_bench.cluster: worker exit codes {codes}" + (" (124 = timed out)" if 124 in codes else ""),
              file=sys.stderr)
    return max(codes) if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
