"""Start N ranks from a notebook (or a script) and get their results back, safely.

Lessons 03, 04 and 06 run every distributed example through :func:`spawn`::

    from dpcourse import launch

    def hello(rank, world_size):
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t.item()

    launch.spawn(hello, 2)            # -> [3.0, 3.0]

Why not ``torch.multiprocessing.spawn`` straight from a notebook cell? Because of what goes
wrong there, each measured on the course's machines (ARCHITECTURE.md § Design rules, launches):

* a function defined in a cell cannot be pickled by reference, so the child dies with
  "Can't get attribute ... on <module '__main__'>". We ship the function by value with
  cloudpickle, so a worker written in a cell just works;
* every rank prints into the cell at once and the lines interleave; we capture each rank's
  output and print it afterwards, rank by rank, each line prefixed with ``[rank k]``;
* a rank that raises leaves the others waiting forever inside a collective; we stop all
  ranks as soon as one fails and raise one :class:`RankFailedError` that names the rank and
  carries its traceback;
* a collective that not every rank calls hangs forever; ``timeout`` ends it with a
  :class:`LaunchTimeoutError` that names the ranks that never finished. A rank whose function
  returned stays alive, its connections open, until every rank is done, so a rank waiting on it
  hangs until that timeout, as it would on a peer that is alive but elsewhere. (In a script, a
  gloo rank whose peer's process really *exits* fails at once instead, with "Connection closed
  by peer": lesson 10, section 2, runs both.)
* the notebook's stop button (KeyboardInterrupt) used to leave workers running and their
  port bound; every exit path here kills each rank's whole process group;
* gloo + DDP workers abort with SIGABRT in about 3% of exits, *after* their work is done;
  workers hand their result back, flush, and leave with ``os._exit`` — and a rank whose
  result already arrived counts as finished, whatever its exit code.

Each launch gets its own free TCP port on 127.0.0.1, so many learners (or tests) can launch at
once on one machine. For scripts, :func:`torchrun` runs ``python -m torch.distributed.run``
with a time limit, rank-prefixed output and the same clean-up.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Sequence

import cloudpickle

__all__ = [
    "spawn",
    "torchrun",
    "torchrun_command",
    "torchrun_env",
    "free_port",
    "kill_tree",
    "worker_entry",
    "wait_for_ranks",
    "LaunchError",
    "RankFailedError",
    "LaunchTimeoutError",
    "TorchrunResult",
    "PEER_LOST",
]

# After the first rank fails, give the others this long to report their own error (so the
# message can name every rank that really failed) before they are killed.
_GRACE_AFTER_FAILURE_S = 1.5

# What a rank raises when it was not the cause: its peer went away mid-collective (aborted,
# raised and was stopped, died). gloo's words; NCCL ranks time out instead.
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|remote worker hanging|"
                        r"Socket closed|Read error")


class LaunchError(RuntimeError):
    """Base class for everything :func:`spawn` and :func:`torchrun` raise about the ranks."""


class RankFailedError(LaunchError):
    """A rank raised (or died). ``rank`` is the first to fail, ``failures`` maps every failed
    rank to its formatted traceback, in the order the failures arrived."""

    def __init__(self, failed: list[tuple[int, str, str]], world_size: int,
                 stopped: Sequence[int] = ()):
        self.rank = failed[0][0]
        self.summary = failed[0][1]
        self.failures = {r: tb for r, _, tb in failed}
        self.world_size = world_size
        lines = [f"rank {self.rank} of {world_size} failed: {self.summary}"]
        if len(failed) > 1:
            others = ", ".join(str(r) for r, _, _ in failed[1:])
            lines.append(f"(then rank(s) {others} failed too, most likely because of it)")
        if stopped:
            lines.append(f"(rank(s) {', '.join(map(str, stopped))} were still running and were "
                         f"stopped)")
        for r, _, tb in failed:
            lines.append(f"\n--- traceback of rank {r} ---\n{tb.rstrip()}")
        super().__init__("\n".join(lines))


class LaunchTimeoutError(LaunchError, TimeoutError):
    """Some ranks did not finish within ``timeout`` seconds; they were killed.

    ``pending`` lists the ranks that never finished (empty when torchrun timed out as a whole),
    ``finished`` those that returned: a rank still waiting after a peer has returned waits for a
    collective that peer will never call — a deadlock, not slowness.

    Shown in lesson 10, §1.
    """

    def __init__(self, message: str, pending: Sequence[int] = (), timeout: float | None = None,
                 finished: Sequence[int] = ()):
        self.pending = list(pending)
        self.finished = list(finished)
        self.timeout = timeout
        super().__init__(message)

    @classmethod
    def for_ranks(cls, pending: list[int], finished: list[int], timeout: float, world_size: int):
        who = ", ".join(map(str, pending))
        done = ", ".join(map(str, finished)) if finished else "none"
        return cls(
            f"rank(s) {who} of {world_size} never finished within {timeout:g} s and were stopped "
            f"(finished: {done}). A rank waiting in a collective that another rank never calls "
            f"hangs like this.",
            pending, timeout, finished,
        )


def _ephemeral_floor() -> int:
    """The lowest port the OS hands to outgoing connections (Linux's default is 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now, chosen at random *below* the OS's
    ephemeral range.

    Why not let the OS pick (bind to port 0)? It picks from the ephemeral range, the same ports
    it gives every outgoing connection, and gloo opens many of those between ranks: in the
    moment between this function closing its socket and rank 0's store binding the port,
    another launch's connection could take it (EADDRINUSE, seen once in a few thousand launches
    on a loaded machine). A port below that range is only ever taken by a listener; two
    launches choosing the same one of ~12,000 at the same moment is the remaining, much smaller
    risk. The OS's pick is the fallback when no such range exists.
    """
    floor = _ephemeral_floor()
    chooser = random.SystemRandom()  # never the global generator: lessons seed it
    if floor > 21000:
        for _ in range(64):
            port = chooser.randrange(20000, floor)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# The worker side. Everything below runs in the child process.
# --------------------------------------------------------------------------------------------


def worker_entry(rank: int, world_size: int, port: int, payload: bytes, env: dict,
                 log_path: str, result_conn, release_conn) -> None:
    """What each rank of :func:`spawn` runs: its own session and log file, the parent's
    environment and the rendezvous variables, then the cloudpickled ``(fn, args, kwargs,
    backend)`` from ``payload``; it sends the result (or the exception with its traceback) back
    on ``result_conn``, then waits on ``release_conn`` until the parent says every rank is done,
    and ends with ``os._exit`` (no atexit handlers: DDP's gloo threads can abort a normal exit).
    A rank that returned early therefore stays alive with its sockets open while the others
    work, which is why a collective its peer still waits in hangs instead of failing at once
    (lesson 04's section on uneven inputs quotes that end). Should the parent die without
    releasing it (a kernel killed or restarted mid-cell), a watcher thread sees ``release_conn``
    close and kills this rank's process group, so no rank outlives its notebook.

    Shown in lesson 00, §"Running many processes from a notebook".
    """
    # Own process group: the parent can then kill this rank *and* anything it started
    # (DataLoader workers, a subprocess) with one killpg.
    os.setsid()
    # Everything the rank prints goes to its own file; the parent prints it in rank order.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)

    # The parent holds the only write end of release_conn: it closes once the parent is done
    # with this rank, or dies. A rank busy in fn (stuck in a collective, polling) would outlive
    # a kernel killed mid-cell, with no one left to kill it; this thread ends it then.
    threading.Thread(target=_end_when_released, args=(release_conn,), daemon=True).start()
    os.environ.update(env)  # the parent's environment *now*, not when the fork server started
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        fn, args, kwargs, backend = cloudpickle.loads(payload)
        if backend is not None:
            import torch.distributed as dist

            dist.init_process_group(backend, rank=rank, world_size=world_size)
        outcome = ("ok", fn(rank, world_size, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        outcome = ("error", f"{type(exc).__name__}: {exc}".strip(), traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        message = cloudpickle.dumps(outcome)
    except Exception as exc:  # the return value itself cannot be pickled
        message = cloudpickle.dumps((
            "error",
            f"{type(exc).__name__}: the return value of rank {rank} could not be sent back "
            f"({exc}); return plain numbers, lists, dicts, arrays or CPU tensors.",
            traceback.format_exc()))
    try:
        result_conn.send_bytes(message)
        result_conn.close()
        # Stay alive, sockets open, until the parent says every rank is done (or dies). A rank
        # that returned early does not tear down the group under a rank still inside a
        # collective: that rank waits, as it would on a peer that is alive but elsewhere, until
        # the parent's timeout names it. (Had this process exited, a gloo peer waiting on it
        # would fail at once with "Connection closed by peer", as a script's rank does: lesson
        # 10, section 2, shows it.) Staying alive is also why we never need
        # destroy_process_group.
        release_conn.recv_bytes()
    except (EOFError, OSError):
        pass
    finally:
        # os._exit skips the interpreter's shutdown, where gloo's threads (kept alive by DDP)
        # sometimes abort the process after all the work is done.
        os._exit(0)


def _end_when_released(release_conn) -> None:
    """Block until ``release_conn`` closes (the parent released this rank, or died), then kill
    this rank's process group: the rank and anything it started."""
    try:
        release_conn.poll(None)
    except (EOFError, OSError):
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# The parent side.
# --------------------------------------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    process: Any
    conn: Any  # results come back on it
    release: Any  # closing it lets the rank exit
    log_path: str
    outcome: tuple | None = None  # ("ok", value) or ("error", summary, traceback)
    arrived: float = 0.0


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group, and every descendant, wherever they moved.

    A process group alone is not enough: torchrun's agent starts its workers in sessions of
    their own, so killing the agent's group left them running (and bound to their ports).
    We list the whole tree first, because once a parent dies its children are re-parented
    and can no longer be found from it.

    Shown in lesson 00, §"Running many processes from a notebook".
    """
    import psutil

    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        tree = []
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError, OSError):
            pass
    for child in tree:
        try:
            child.kill()
        except psutil.Error:
            pass


def _context(start_method: str):
    ctx = get_context(start_method)
    if start_method == "forkserver":
        # The fork server imports torch once; each rank is then a cheap fork of it instead of
        # a fresh interpreter importing torch again (about 3 s per rank on a 2-core machine).
        # torch._dynamo too: wrapping a model in DDP imports it (and ~900 modules with it),
        # which cost 4-5 s in *every* launch until it was preloaded here.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                    "torch.nn.parallel", "cloudpickle", "dpcourse.launch"])
    return ctx


def spawn(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str | None = None,
    show_output: bool = True,
    start_method: str = "forkserver",
    **kwargs: Any,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` processes.

    Returns the ranks' return values as a list indexed by rank. ``fn`` may be defined in a
    notebook cell. Each rank sees RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
    its environment (a fresh free port per launch), so ``dist.init_process_group(backend)``
    with the default ``env://`` works. With ``backend="gloo"`` (or "nccl"), the group is set up
    before ``fn`` runs; with ``backend=None``, ``fn`` sets up its own. Nothing destroys it: once
    ``fn`` has returned, the rank hands its result back and waits, its sockets open, until this
    process releases it (every rank has returned, or the launch ends on a failure, a timeout or
    a stop), so that no rank leaves a collective that a slower rank is still in; then it leaves
    with ``os._exit(0)``, skipping the interpreter's shutdown (DDP keeps gloo's threads alive,
    and a normal shutdown aborted about 3% of runs: measured when the course was built, not in
    a lesson; ARCHITECTURE.md, "Launches"). This process then kills every rank's
    process group, finished or not.

    Raises :class:`RankFailedError` if a rank raises, :class:`LaunchTimeoutError` if some rank
    is not done after ``timeout`` seconds, and re-raises KeyboardInterrupt; in every case all
    ranks (and their children) are killed before this returns.

    Shown in lesson 00, §"Running many processes from a notebook".
    """
    if not callable(fn):
        raise TypeError(f"spawn() needs a function to run on every rank, got {type(fn).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be None, 'gloo' or 'nccl', got {backend!r}")
    try:
        payload = cloudpickle.dumps((fn, args, kwargs, backend))
    except Exception as exc:
        raise TypeError(
            f"spawn() could not send {getattr(fn, '__name__', fn)!r} or its arguments to the "
            f"ranks ({type(exc).__name__}: {exc}). Pass plain data (numbers, arrays, CPU "
            f"tensors, dataclasses), not open files, locks or live process groups."
        ) from None

    ctx = _context(start_method)
    port = free_port()
    env = dict(os.environ)
    logdir = tempfile.mkdtemp(prefix="dpcourse-spawn-")
    ranks: list[_Rank] = []
    try:
        # A stop (SIGINT: Jupyter's stop button) that lands while ranks are starting would
        # raise inside p.start() or just after it, before the rank is in `ranks`, and the
        # cleanup below would leave that rank running, holding its port. So the stop waits
        # until every started rank is registered (a fraction of a second), then takes effect.
        with _SigintAfterStart():
            _start_ranks(ctx, ranks, world_size, port, payload, env, logdir)
        wait_for_ranks(ranks, timeout, world_size)
    finally:
        for rk in ranks:
            rk.release.close()  # finished ranks exit on their own now
        deadline = time.monotonic() + 2.0
        for rk in ranks:
            if rk.outcome is not None and rk.outcome[0] == "ok":
                rk.process.join(timeout=max(0.0, deadline - time.monotonic()))
        # Then kill every rank's process group, finished or not: a stuck rank must go, and a
        # finished one may have left children behind (a DataLoader worker, a subprocess).
        for rk in ranks:
            kill_tree(rk.process.pid)
        for rk in ranks:
            rk.process.join(timeout=5)
            rk.conn.close()
        if show_output:
            _print_outputs(ranks)
        for rk in ranks:
            try:
                os.unlink(rk.log_path)
            except OSError:
                pass
        try:
            os.rmdir(logdir)
        except OSError:
            pass
    return [rk.outcome[1] for rk in ranks]


def _start_ranks(ctx, ranks: list, world_size: int, port: int, payload: bytes, env: dict,
                 logdir: str) -> None:
    """Start one process per rank, appending each to ``ranks`` as soon as it runs."""
    for r in range(world_size):
        result_r, result_w = ctx.Pipe(duplex=False)
        release_r, release_w = ctx.Pipe(duplex=False)
        log_path = os.path.join(logdir, f"rank{r}.log")
        p = ctx.Process(
            target=worker_entry,
            args=(r, world_size, port, payload, env, log_path, result_w, release_r),
            name=f"dpcourse-rank{r}",
            daemon=True,
        )
        p.start()
        # Close the child's ends here, so that a dead child shows up as EOF.
        result_w.close()
        release_r.close()
        ranks.append(_Rank(r, p, result_r, release_w, log_path))


class _SigintAfterStart:
    """Hold a SIGINT back until the block ends, then deliver it to the handler it would have
    met (the kernel's KeyboardInterrupt during a cell). A signal mask would not do: SIGINT is
    sent to the process, and a kernel has threads that do not block it. Only the main thread
    may set handlers; elsewhere this does nothing."""

    def __enter__(self):
        import threading

        self.pending, self.saved = False, None
        if threading.current_thread() is threading.main_thread():
            self.saved = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.pending = True

    def __exit__(self, *exc) -> bool:
        if self.saved is not None:
            signal.signal(signal.SIGINT, self.saved)
            if self.pending:
                signal.raise_signal(signal.SIGINT)  # now, with every started rank registered
        return False

def wait_for_ranks(ranks: list[_Rank], timeout: float, world_size: int) -> None:
    """How :func:`spawn` waits: it polls every unfinished rank's result pipe (half a second at
    most per poll) until each rank has sent its result, or ``_GRACE_AFTER_FAILURE_S`` (1.5 s)
    after the first rank reported an error, or until ``timeout`` seconds from the start; then it
    raises :class:`RankFailedError` if any rank failed, else :class:`LaunchTimeoutError` naming
    the ranks still pending. It kills nothing: ``spawn``'s ``finally`` kills every rank's
    process tree afterwards, which is what stops a rank still busy.

    Shown in lesson 00, §"Running many processes from a notebook".
    """
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        pending = [rk for rk in ranks if rk.outcome is None]
        if not pending:
            break
        now = time.monotonic()
        if failed_at is not None and now - failed_at > _GRACE_AFTER_FAILURE_S:
            break
        if now >= deadline:
            break
        limit = deadline - now
        if failed_at is not None:
            limit = min(limit, _GRACE_AFTER_FAILURE_S - (now - failed_at))
        ready = wait([rk.conn for rk in pending], timeout=max(0.0, min(limit, 0.5)))
        for rk in pending:
            if rk.conn in ready:
                try:
                    rk.outcome = cloudpickle.loads(rk.conn.recv_bytes())
                except (EOFError, OSError):
                    # The pipe closed without a result: the rank died (segfault, SIGKILL, OOM).
                    rk.process.join(timeout=2)
                    code = rk.process.exitcode
                    how = (f"killed by signal {signal.Signals(-code).name}" if code and code < 0
                           else f"exit code {code}")
                    rk.outcome = ("error", f"the process died without a result ({how})",
                                  "(no Python traceback: the process ended abruptly)")
                rk.arrived = time.monotonic()
                if rk.outcome[0] == "error" and failed_at is None:
                    failed_at = rk.arrived
    # Arrival order: the first rank to fail is usually the cause, the rest its echoes. Not
    # always: when one rank aborts inside a collective, its peer's "Connection reset by peer"
    # can reach us first (seen in CI). A rank that only lost its peer is named after the others.
    failed = sorted((rk for rk in ranks if rk.outcome and rk.outcome[0] == "error"),
                    key=lambda rk: (bool(PEER_LOST.search(rk.outcome[1])), rk.arrived))
    if failed:
        still_running = [rk.rank for rk in ranks if rk.outcome is None]
        raise RankFailedError([(rk.rank, rk.outcome[1], rk.outcome[2]) for rk in failed],
                              world_size, still_running)
    pending = [rk.rank for rk in ranks if rk.outcome is None]
    if pending:
        finished = [rk.rank for rk in ranks if rk.outcome is not None]
        raise LaunchTimeoutError.for_ranks(pending, finished, timeout, world_size)


def _print_outputs(ranks: list[_Rank]) -> None:
    for rk in ranks:
        try:
            text = Path(rk.log_path).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            print(f"[rank {rk.rank}] {line}")


# --------------------------------------------------------------------------------------------
# torchrun, for scripts
# --------------------------------------------------------------------------------------------


@dataclass
class TorchrunResult:
    """What a torchrun launch left behind: its exit code and its (rank-prefixed) output."""

    returncode: int
    output: str
    command: list[str]

    def check(self) -> "TorchrunResult":
        if self.returncode != 0:
            tail = "\n".join(self.output.splitlines()[-40:])
            raise LaunchError(f"torchrun exited with code {self.returncode}:\n{tail}")
        return self


def torchrun_command(script: str | os.PathLike, *script_args: str, nnodes: int | str,
                     nproc_per_node: int, rdzv_endpoint: str, rdzv_id: str,
                     options: Sequence[str] = ()) -> list[str]:
    """The ``torchrun`` command line of one node (``python -m torch.distributed.run``, so the
    torchrun of this interpreter): c10d rendezvous at ``rdzv_endpoint``, every worker's output
    teed (``--tee=3``) so that it reaches the caller, ``options`` before the script. Used by
    :func:`torchrun` and by ``ddp_practice.run_nodes`` (several nodes on one machine)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        *options,
        "--tee=3",
        str(script),
        *map(str, script_args),
    ]


def torchrun_env(env: dict | None = None) -> dict:
    """The environment of a torchrun job: this process's, each worker line prefixed
    ``[rank k]``, unbuffered output, one CPU thread per worker unless ``OMP_NUM_THREADS`` is set
    (torchrun itself sets 1 for several workers, with a warning: ``torch/distributed/run.py``),
    then ``env`` on top."""
    run_env = dict(os.environ)
    run_env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank ${rank}] ")
    run_env.setdefault("PYTHONUNBUFFERED", "1")
    run_env.setdefault("OMP_NUM_THREADS", "1")
    if env:
        run_env.update(env)
    return run_env


def torchrun(
    script: str | os.PathLike,
    *script_args: str,
    nproc_per_node: int = 2,
    nnodes: int | str = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "dpcourse",
    max_restarts: int = 0,
    timeout: float = 300.0,
    extra_args: Sequence[str] = (),
    env: dict | None = None,
    cwd: str | os.PathLike | None = None,
    echo: bool = True,
    check: bool = True,
) -> TorchrunResult:
    """Run ``torchrun ... script script_args`` with a time limit and clean-up.

    Output of every worker is prefixed with its rank (torchrun's ``--tee 3`` with
    ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), collected, and returned (``echo`` also prints
    it when the run ends, so it never interleaves with other cells). The whole process tree
    runs in its own session; on timeout, error or KeyboardInterrupt it is killed, leaving no
    worker and no bound port. A single-node run gets a free port on 127.0.0.1 for its
    rendezvous; pass ``rdzv_endpoint`` (and ``nnodes``) to join several "nodes".
    """
    script = Path(script)
    if not script.exists():
        raise FileNotFoundError(f"torchrun: no such script {script}")
    if rdzv_endpoint is None:
        rdzv_endpoint = f"127.0.0.1:{free_port()}"
    cmd = torchrun_command(script, *script_args, nnodes=nnodes, nproc_per_node=nproc_per_node,
                           rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                           options=(f"--max-restarts={max_restarts}", *extra_args))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=torchrun_env(env), cwd=cwd, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        if echo:
            print(out.rstrip())
        raise LaunchTimeoutError(
            f"torchrun did not finish within {timeout:g} s; it and all its workers were stopped.",
            timeout=timeout) from None
    except BaseException:  # KeyboardInterrupt included: the notebook's stop button
        kill_tree(proc.pid)
        proc.communicate()
        raise
    result = TorchrunResult(proc.returncode, out, cmd)
    if echo:
        print(out.rstrip())
    return result.check() if check else result
