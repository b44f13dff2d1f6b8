"""The multi-process test harness of every mori package: test bodies in real, spawned processes.

``run_procs(fn, [args0, args1, ...])`` starts one spawned process per argument tuple, returns
``[fn(*args0), fn(*args1), ...]`` in order, and fails with the child's traceback (or exit code)
as soon as one fails. Children still alive at the deadline or after a failure are killed.

``ProcPool(n)`` keeps ``n`` such processes alive across calls, so one set of ranks can serve
many hypothesis examples: ``pool.map(fn, arg_lists)`` / ``pool.run(fn, *args)``. Inside a
worker, :func:`context` gives its index, the pool size, a ``state`` dict that survives between
calls (a bootstrap, say) and ``share(value)``, which hands worker 0's value to every worker
(a unique id, say) through the parent once all of them have asked: a start line, so that no
rank's timeout starts while another is still importing.

``ProcPool(n, env=..., label="PE", keep_on_error=True)`` is the form mori.shmem's tests use: each
worker starts with ``env`` in its environment, and a function that raises in some workers raises
:class:`WorkerError` naming them (``PE 1: ShmemError: ...``) once every worker has answered,
leaving the pool usable. A death or a timeout always closes the pool.

``ProcPool(1, start=...)`` hands each worker process to ``start`` instead of starting it (mori.io's
tests start their engine processes inside a network namespace that way); ``pids`` lets a test
signal a worker (SIGSTOP a peer, say).

``stop_process(pid)`` stops a process (SIGSTOP) and returns once every thread of it is stopped:
``kill`` only queues the stop, and a thread that polls (a UCX progress thread) goes on serving
until the kernel stops it, which on a loaded machine can be after the test's next request went
out. A test of a hung peer calls it rather than ``os.kill`` (``os.kill(pid, SIGCONT)`` resumes).

``CommandProcess(setup, args)`` is one worker driven by named commands, the form of a test's
target or peer process: ``setup(*args)`` builds what the process serves (an engine, a native
target), hands its commands to :func:`serve_commands` and returns what the test needs (a port, a
descriptor: ``ready``); ``call(name, *args)`` then runs one command there. mori-io's
``PipeProcess`` (every engine process of its tests), mori-core's data-plane tests and
``ci/io_hardening.py`` drive their processes this way.

``connect_many(port, n)`` opens up to ``n`` silent connections to a listener, stopping at the first
refusal (the hostile-peer tests of core and io, and ``ci/io_hardening.py``).

``network_namespaces()`` makes two network namespaces joined by a veth pair (two "hosts" on one
machine; needs root and iproute2) and removes them after; ``start_in_netns(ns)`` is a ``start``
hook that starts a worker inside one (``CommandProcess(..., start=start_in_netns(ns))``).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import spawn as mp_spawn
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = [
    "CommandProcess",
    "Died",
    "Namespace",
    "ProcPool",
    "WorkerContext",
    "WorkerError",
    "connect_many",
    "context",
    "host_congestion_control",
    "network_namespaces",
    "run_procs",
    "serve_commands",
    "standin_counters",
    "standin_make_current",
    "standin_knobs",
    "standin_stager",
    "start_in_netns",
    "stop_process",
]


@dataclass
class WorkerContext:
    """What a pool worker knows about itself."""

    index: int
    size: int
    conn: Connection
    state: dict[str, Any] = field(default_factory=dict)

    def share(self, value: Any = None, root: int = 0) -> Any:
        """Every worker calls this in the same call; all get worker ``root``'s ``value``."""
        self.conn.send(("share", value if self.index == root else None, self.index == root))
        while True:
            msg = self.conn.recv()
            if msg[0] == "shared":
                return msg[1]


@dataclass(frozen=True)
class Died:
    """The result of a worker that was allowed to die (``may_die``) and did."""

    exitcode: int | None


class WorkerError(AssertionError):
    """A function raised in some workers; ``failures`` maps each worker to its message and traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        super().__init__("\n".join(failures.values()))
        self.failures = failures


_context: WorkerContext | None = None


def context() -> WorkerContext:
    """This worker's context; only inside a function a pool runs."""
    if _context is None:
        raise RuntimeError("mori.core.testing.context() is only available inside a ProcPool worker")
    return _context


def _worker(index: int, size: int, conn: Connection, env: dict[str, str], label: str) -> None:
    global _context
    os.environ.update(env)
    _context = WorkerContext(index, size, conn)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        if msg[0] != "call":
            continue  # the answer to a share this worker did not take part in
        _, fn, args = msg
        try:
            reply: tuple[str, Any] = ("done", fn(*args))
        except BaseException as exc:  # reported, the parent decides
            reply = ("error", f"{label} {index}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            conn.send(reply)
        except Exception as exc:
            conn.send(("error", f"result of {fn.__name__} could not be sent back: {exc!r}"))


class ProcPool:
    """``n`` spawned worker processes that run functions on request, reused across calls.

    A death or a timeout in any worker kills them all and raises ``AssertionError`` naming the
    worker; the pool is then closed. A function that raises does the same, unless
    ``keep_on_error``: then the call waits for every worker's answer and raises
    :class:`WorkerError`, and the pool stays open. Workers start with ``env`` added to their
    environment; messages name a worker as ``f"{label} {index}"``. ``start``, when given, is called
    with each new (spawn-context) process in place of ``process.start()``.
    """

    def __init__(
        self,
        n: int,
        timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        label: str = "process",
        keep_on_error: bool = False,
        start: Callable[[BaseProcess], None] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.timeout, self.label, self.keep_on_error = timeout, label, keep_on_error
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._closed = False
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker, args=(i, n, child, dict(env or {}), label), daemon=True, name=f"mori-test-{i}"
                )
                if start is None:
                    proc.start()
                else:
                    start(proc)
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        except BaseException:
            self.kill()
            raise

    @property
    def size(self) -> int:
        """How many workers the pool has."""
        return len(self._procs)

    @property
    def pids(self) -> list[int | None]:
        """The workers' process ids, in worker order."""
        return [proc.pid for proc in self._procs]

    def __enter__(self) -> ProcPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Runs ``fn(*args)`` in every worker; returns the results in worker order."""
        return self.map(fn, [args] * len(self._procs), timeout=timeout)

    def run_on(self, index: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Runs ``fn(*args)`` in worker ``index`` alone; returns its result."""
        return self._call({index: args}, fn, timeout, ())[index]

    def map(
        self,
        fn: Callable[..., Any],
        arg_lists: Sequence[tuple[Any, ...]],
        timeout: float | None = None,
        may_die: Collection[int] = (),
    ) -> list[Any]:
        """Runs ``fn(*arg_lists[i])`` in worker i; returns the results in order.

        Workers listed in ``may_die`` may exit instead of answering: their result is :class:`Died`.
        """
        if len(arg_lists) != len(self._procs):
            raise ValueError(f"{len(arg_lists)} argument tuples for {len(self._procs)} workers")
        out = self._call(dict(enumerate(arg_lists)), fn, timeout, may_die)
        return [out[i] for i in range(len(self._procs))]

    def _call(
        self, calls: dict[int, tuple[Any, ...]], fn: Callable[..., Any], timeout: float | None, may_die: Collection[int]
    ) -> dict[int, Any]:
        if self._closed:
            raise RuntimeError("this ProcPool is closed (an earlier call failed)")
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        for i, args in calls.items():
            self._conns[i].send(("call", fn, tuple(args)))
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        self._shares: list[tuple[Any, bool]] = []
        try:
            while len(out) + len(failures) < len(calls):
                pending = [self._conns[i] for i in calls if i not in out and i not in failures]
                ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    missing = sorted(set(calls) - set(out) - set(failures))
                    raise AssertionError(f"{self.label} {missing} did not finish within {limit} s")
                for conn in ready:
                    self._take(self._conns.index(conn), out, failures, may_die, len(calls))  # type: ignore[arg-type]
        except BaseException:
            self.kill()
            raise
        if failures:
            raise WorkerError(failures)
        return out

    def _take(
        self, i: int, out: dict[int, Any], failures: dict[int, str], may_die: Collection[int], calls: int
    ) -> None:
        try:
            kind, value, *rest = self._conns[i].recv()
        except (EOFError, OSError):
            self._procs[i].join(timeout=5)
            if i in may_die:
                out[i] = Died(self._procs[i].exitcode)
                return
            raise AssertionError(
                f"{self.label} {i} died with exit code {self._procs[i].exitcode} before reporting"
            ) from None
        if kind == "share":
            self._shares.append((value, rest[0]))
            if len(self._shares) == calls - len(out) - len(failures):
                shared = [v for v, from_root in self._shares if from_root]
                if len(shared) != 1:
                    raise AssertionError(f"share(): {len(shared)} workers said they were the root, expected 1")
                for j, conn in enumerate(self._conns):
                    if j not in out and j not in failures:
                        conn.send(("shared", shared[0]))
                self._shares = []
        elif kind == "error":
            failures[i] = value
            if not self.keep_on_error:
                raise WorkerError(failures)
        else:
            out[i] = value

    def close(self) -> None:
        """Asks the workers to stop, then kills any that do not within 5 s."""
        if self._closed:
            return
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kills every worker still alive and closes the pipes."""
        self._closed = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()


def stop_process(pid: int | None, timeout: float = 5.0) -> None:
    """Sends SIGSTOP to process ``pid`` and waits until every thread of it is stopped (state ``T``
    in ``/proc/PID/task/*/stat``), at most ``timeout`` seconds; raises ``AssertionError`` naming
    the threads still running after that. Linux only."""
    if pid is None:
        raise ValueError("stop_process: the process has no pid (not started)")
    os.kill(pid, signal.SIGSTOP)
    tasks = f"/proc/{pid}/task"
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for tid in os.listdir(tasks):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError), open(f"{tasks}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
                if state not in ("T", "t"):
                    running.append(f"{tid} ({state})")
        if not running:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"process {pid}: threads {', '.join(running)} not stopped within {timeout} s of SIGSTOP"
            )
        time.sleep(0.001)


def run_procs(fn: Callable[..., Any], arg_lists: Sequence[tuple[Any, ...]], timeout: float = 120.0) -> list[Any]:
    """Runs ``fn(*args)`` for each ``args`` in its own spawned process; returns the results in order."""
    with ProcPool(len(arg_lists), timeout=timeout) as pool:
        return pool.map(fn, arg_lists)


def serve_commands(commands: Mapping[str, Callable[..., Any]], *keep: Any) -> None:
    """Inside a :class:`CommandProcess`'s setup: serves ``commands`` (name -> function) to
    :meth:`CommandProcess.call`, a command named ``close`` also to :meth:`CommandProcess.close`.
    ``keep`` are objects that must live as long as the process (memory that a registration points
    at, which nothing else may reference once setup returns)."""
    context().state.update(commands=dict(commands), keep=keep)


def _run_command(name: str, args: tuple[Any, ...]) -> Any:
    commands = context().state.get("commands", {})
    if name not in commands:
        raise KeyError(f"no command {name!r} (this process serves {sorted(commands)})")
    return commands[name](*args)


def _run_close() -> None:
    close = context().state.get("commands", {}).get("close")
    if close is not None:
        close()


class CommandProcess:
    """One spawned worker that ran ``setup(*args)`` (which ends with :func:`serve_commands`;
    what it returned is ``ready``) and runs its commands on request.

    Every call is bounded by ``timeout`` seconds. A command that raises raises ``RuntimeError``
    with the process's traceback and the process stays; one that dies or does not answer in time
    raises ``AssertionError`` and the process is killed. ``name`` labels the messages; ``env``
    and ``start`` are :class:`ProcPool`'s.
    """

    def __init__(
        self,
        setup: Callable[..., Any],
        args: Sequence[Any] = (),
        name: str = "process",
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        start: Callable[[BaseProcess], None] | None = None,
    ) -> None:
        self.name = name
        self._pool = ProcPool(1, timeout=timeout, env=env, label=name, keep_on_error=True, start=start)
        try:
            self.ready: Any = self._pool.run_on(0, setup, *args)
        except BaseException:
            self._pool.kill()
            raise

    @property
    def pid(self) -> int | None:
        """The process id."""
        return self._pool.pids[0]

    @property
    def exitcode(self) -> int | None:
        """None while the process runs; then its exit code (negative: the signal that ended it)."""
        return self._pool._procs[0].exitcode

    def call(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        """Runs command ``name`` with ``args`` in the process and returns its result."""
        try:
            return self._pool.run_on(0, _run_command, name, args, timeout=timeout)
        except WorkerError as err:
            raise RuntimeError(f"{self.name} {name} failed: {err}") from None

    def signal(self, sig: int) -> None:
        """Sends signal ``sig`` to the process (nothing once it is gone)."""
        if self.pid is not None and self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the process (SIGSTOP) and returns once every thread of it is stopped
        (:func:`stop_process`); ``signal(signal.SIGCONT)`` resumes it."""
        stop_process(self.pid, timeout)

    def kill(self) -> None:
        """Kills and reaps the process."""
        self._pool.kill()

    def close(self) -> None:
        """Runs the ``close`` command where there is one, then stops the process (killed if it
        does not stop within 5 s). A process that died, hangs or fails to close is killed."""
        try:
            self._pool.run_on(0, _run_close)
        except (AssertionError, RuntimeError, OSError):
            pass  # dead, hung or failed: killed below
        finally:
            self._pool.close()


def connect_many(port: int, n: int, host: str = "127.0.0.1", timeout: float = 5.0) -> list[socket.socket]:
    """Opens up to ``n`` TCP connections to ``host:port`` and returns them; stops at the first one
    that fails (refused, timed out, or this process out of descriptors)."""
    socks: list[socket.socket] = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection((host, port), timeout=timeout))
        except OSError:
            break
    return socks


@dataclass(frozen=True)
class Namespace:
    """A network namespace made by :func:`network_namespaces`: its name, its end of the veth
    pair and that end's IPv4 address."""

    name: str
    device: str
    address: str


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


def host_congestion_control() -> str:
    """The TCP congestion control that namespaces standing in for hosts use: ``cubic`` (Linux's
    default) when this kernel has it, else "" (the kernel's default). Set on the namespaces'
    route, as ``ip route ... congctl`` (a namespace's sysctl may refuse an algorithm the host did
    not allow). Why: a machine that defaults to BBR paces each connection over the veth pair at a
    bandwidth estimated from application-limited samples; a connection that leaves BBR's start-up
    phase then moves 1 MiB at half speed and delays small messages, at random and for the rest of
    its life, which no transfer between real hosts on a NIC's bandwidth shows."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return "cubic" if "cubic" in f.read().split() else ""
    except OSError:
        return ""


@contextlib.contextmanager
def network_namespaces(subnet: str = "10.231.9") -> Iterator[tuple[Namespace, Namespace]]:
    """Two network namespaces joined by a veth pair, at ``subnet``.1 and ``subnet``.2 (a real
    network path through the kernel, not loopback); removed on exit. Needs root and iproute2: a
    test that uses it fails, never skips, without them.

    TCP between them runs CUBIC (:func:`host_congestion_control`), set on the route."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise RuntimeError("network namespaces need root and iproute2 (ci/setup.sh installs iproute2; CI runs as root)")
    congestion = host_congestion_control()
    created: list[str] = []  # only these are removed: a name that was taken belongs to someone else
    try:
        ends = _new_namespaces(subnet, created)
        _ip("link", "add", ends[0].device, "type", "veth", "peer", "name", ends[1].device)
        for ns in ends:
            _ip("link", "set", ns.device, "netns", ns.name)
            _ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", ns.device)
            _ip("-n", ns.name, "link", "set", ns.device, "up")
            _ip("-n", ns.name, "link", "set", "lo", "up")
            if congestion:
                _ip("-n", ns.name, "route", "replace", f"{subnet}.0/24", "dev", ns.device, "congctl", congestion)
        yield ends
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _new_namespaces(subnet: str, created: list[str]) -> tuple[Namespace, Namespace]:
    """Two network namespaces of names no one holds, made (their names appended to ``created``
    as they are): a tag of this process's id and a random number, passed over where a namespace
    or device of its names exists (another test of this process, or one that a killed run left:
    CI once failed on "File exists" with a tag from the clock)."""
    for _ in range(50):
        tag = f"{os.getpid() % 100000}x{random.randrange(1000)}"
        ends = (
            Namespace(f"mori_c{tag}a", f"mc{tag}a", f"{subnet}.1"),
            Namespace(f"mori_c{tag}b", f"mc{tag}b", f"{subnet}.2"),
        )
        if any(os.path.exists(f"/run/netns/{ns.name}") or os.path.exists(f"/sys/class/net/{ns.device}") for ns in ends):
            continue
        for ns in ends:
            _ip("netns", "add", ns.name)
            created.append(ns.name)
        return ends
    raise RuntimeError("no free network namespace names: 50 random tags were all taken (leftover mori_c* namespaces?)")


_NETNS_PYTHON: dict[str, str] = {}


def start_in_netns(netns: str | None) -> Callable[[BaseProcess], None]:
    """A ``start`` hook for :class:`ProcPool`/:class:`CommandProcess`: starts the worker inside
    network namespace ``netns`` (``None``: here). Through ``ip netns exec``, which also mounts the
    namespace's /sys, where UCX and others look up network interfaces."""

    def start(proc: BaseProcess) -> None:
        if netns is None:
            proc.start()
            return
        path = _NETNS_PYTHON.get(netns)
        if path is None:
            fd, path = tempfile.mkstemp(prefix="mori-netns-", suffix=".sh")
            with os.fdopen(fd, "w") as f:
                f.write(f'#!/bin/sh\nexec ip netns exec {shlex.quote(netns)} {shlex.quote(sys.executable)} "$@"\n')
            os.chmod(path, 0o755)
            atexit.register(os.unlink, path)
            _NETNS_PYTHON[netns] = path
        before = mp_spawn.get_executable()
        mp_spawn.set_executable(path)
        try:
            proc.start()
        finally:
            mp_spawn.set_executable(before)

    return start


def standin_stager(timeout: float = 30.0, cache_bytes: int | None = None) -> Any:
    """A :class:`mori.core.staging.Stager` whose driver is a host stand-in, for tests on machines
    with no GPU: the native staging code runs as it does on a GPU, but "device" addresses are host
    addresses, a copy is a ``memcpy`` made when it is queued, its end is seen when
    :func:`standin_knobs` says, and pinned memory is heap memory. Hand it to the data planes
    (``staging=``) with host memory standing in for GPU memory."""
    from ._native.gpu import STAGING_CACHE_BYTES, host_standin_stager

    return host_standin_stager(timeout, STAGING_CACHE_BYTES if cache_bytes is None else cache_bytes)


def standin_knobs(
    fail_copy_in: int = -1,
    fail_pinning: bool = False,
    delay: float = 0.0,
    hang: bool = False,
    fail_later: bool = False,
    refuse_batch: bool = False,
) -> None:
    """How the stand-in of :func:`standin_stager` misbehaves from now on (for the whole process):
    the copy after ``fail_copy_in`` more copies fails as it is queued (0: the next one; -1: none),
    every allocation of pinned memory fails (``fail_pinning``: the staging falls back to heap
    memory), each copy ends ``delay`` seconds after it is queued, or never (``hang``: waits run
    into the timeout), or every copy fails as the "device" runs it (``fail_later``: its end is
    never written and its stream's query answers CUresult 999, as a GPU's failed copy would), or
    its ``cuMemcpyBatchAsync`` answers ``CUDA_ERROR_NOT_SUPPORTED`` (``refuse_batch``, as a driver
    without it would: copies of several ranges then go one call each; a batch call counts as one
    copy for ``fail_copy_in``). Call it with no arguments to make it behave again."""
    from ._native.gpu import host_standin_knobs

    host_standin_knobs(fail_copy_in, fail_pinning, delay, hang, fail_later, refuse_batch)


def standin_counters() -> dict[str, int]:
    """What the stand-in has done in this process: ``copies`` (driver calls; a batch call counts
    once), ``batches`` (of them, batch calls), ``largest_batch`` (the most copies one batch call
    took), ``copied_bytes``, ``allocations`` and ``frees`` of pinned memory, and ``pushes``:
    contexts pushed by staging calls on threads that did not have the stand-in's context current
    (see :func:`standin_make_current`)."""
    from ._native.gpu import host_standin_counters

    return host_standin_counters()


def standin_make_current() -> None:
    """Makes the stand-in's context current on the calling thread, as an application's
    ``cuCtxSetCurrent`` (or PyTorch on the device's primary context) would: staging calls there
    then push no context (``standin_counters()["pushes"]`` stays)."""
    from ._native.gpu import host_standin_make_current

    host_standin_make_current()
