"""Detectors for broken distributed programs: each diagnoses one kind of bug from the outside.

Lesson 10 runs every bug of its zoo (``dpcourse.bugzoo``) and shows the detector that finds it;
they are meant for your own scripts too:

* :func:`diagnose` runs a worker function (or, from the command line,
  ``python -m dpcourse diagnose script.py``, a torchrun-style script) on N ranks with a short
  time limit and reports: did it finish, hang or fail; which ranks were stuck, in which
  collective, at which line of your code (a per-rank **collective trace** written as each call
  starts, and a Python stack dump of every rank taken just before the time limit);
* :func:`compare_traces` finds the first collective where the ranks disagree (a rank that never
  calls it, or calls another one, or with another shape);
* :func:`state_checksums` / :func:`compare_checksums` find replicas whose weights, buffers or
  gradients differ (seeds without a broadcast, gradients never averaged, BatchNorm statistics);
* :func:`first_nonfinite` names the rank and step where a NaN first appeared, before an
  all-reduce spread it to every rank;
* :func:`repeated_epoch_orders` spots a sampler that deals the same order every epoch;
* :func:`unused_parameters` lists the parameters a forward never touches;
* :func:`record_saves` / :func:`duplicate_writers` spot several ranks writing one file;
* :func:`port_owner` says who already listens on a port.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = [
    "trace_collectives",
    "caller_line",
    "read_traces",
    "compare_traces",
    "TraceReport",
    "diagnose",
    "Diagnosis",
    "user_frames",
    "state_checksums",
    "compare_checksums",
    "first_nonfinite",
    "repeated_epoch_orders",
    "unused_parameters",
    "record_saves",
    "duplicate_writers",
    "port_owner",
]

_SKIP_FRAMES = (f"{os.sep}torch{os.sep}", "detectors.py", "launch.py", f"{os.sep}runpy",
                "<frozen", "c10d_logger", f"dpcourse{os.sep}collectives.py")


# --------------------------------------------------------------------------------------------
# The collective trace
# --------------------------------------------------------------------------------------------


def _first_shape(arguments: dict) -> list | None:
    import torch

    for a in arguments.values():
        if isinstance(a, torch.Tensor):
            return list(a.shape)
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return [len(a), *a[0].shape]
    return None


def _root(call) -> int | None:
    """The sending or receiving rank a rooted collective names (broadcast's and scatter's src,
    reduce's and gather's dst): ranks that name different roots disagree even when kind and
    shape match. None for the others."""
    if call.function not in ("broadcast", "broadcast_object_list", "reduce", "scatter",
                             "gather", "scatter_object_list", "gather_object"):
        return None
    for name in ("src", "dst", "group_src", "group_dst"):
        value = (call.args or {}).get(name)
        if isinstance(value, int):
            return value
    return None


def caller_line() -> str:
    """file:line of the innermost frame outside torch and the course's plumbing
    (``_SKIP_FRAMES``): the line of the user's code that made the call. Shown in lesson 10, §2.
    """
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(s in frame.filename for s in _SKIP_FRAMES):
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def trace_collectives(path: str | os.PathLike, monitor: float | None = None):
    """Within the block, every call this process makes through ``dist.<name>`` is written to
    ``path``: a JSON line when it starts, one when it returns, flushed at once, so the trace
    survives a rank that hangs and is killed. The recorder swaps the ``torch.distributed``
    module's functions, so calls inside torch (DDP's buckets) and names bound before the block
    (``from torch.distributed import all_reduce``) escape it.

    ``monitor`` (seconds, gloo only): every rank first calls ``dist.monitored_barrier(timeout=
    monitor, wait_all_ranks=True)``; rank 0 then raises naming the ranks that did not arrive.

    Shown in lesson 10, §2.
    """
    import datetime

    import torch.distributed as dist

    from .collectives import record_collectives

    with open(path, "a", buffering=1) as f:
        def start(call):
            f.write(json.dumps({"i": call.index, "op": call.function,
                                "shape": _first_shape(call.args), "root": _root(call),
                                "where": caller_line(), "event": "start"}) + "\n")
            if monitor is not None:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=monitor),
                                       wait_all_ranks=True)

        def end(call):
            f.write(json.dumps({"i": call.index, "event": "end"}) + "\n")

        with record_collectives(before=start, after=end):
            yield path


def read_traces(directory: str | os.PathLike, world_size: int) -> dict[int, list[dict]]:
    """{rank: [{"i", "op", "shape", "root", "where", "done"}, ...]} from the ``rankN.trace``
    files :func:`trace_collectives` wrote; ``done``: the call's "end" line was written.
    Shown in lesson 10, §2.
    """
    traces = {}
    for r in range(world_size):
        calls: dict[int, dict] = {}
        p = Path(directory) / f"rank{r}.trace"
        for line in (p.read_text().splitlines() if p.exists() else []):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the kill
                continue
            if rec["event"] == "start":
                calls[rec["i"]] = {k: rec.get(k) for k in ("i", "op", "shape", "root",
                                                            "where")} | {"done": False}
            elif rec["i"] in calls:
                calls[rec["i"]]["done"] = True
        traces[r] = [calls[i] for i in sorted(calls)]
    return traces


@dataclass
class TraceReport:
    """What :func:`compare_traces` found. ``ok``: every rank made the same calls in the same
    order; otherwise ``index`` is the first call where they differ, ``calls`` what each rank did
    there (None: it made no such call), and ``stuck`` the ranks still inside a call.

    Shown in lesson 10, §2.
    """

    ok: bool
    index: int | None = None
    calls: dict[int, dict | None] = field(default_factory=dict)
    stuck: dict[int, dict] = field(default_factory=dict)

    def message(self) -> str:
        if self.ok:
            return "collective trace: every rank made the same calls, in the same order"
        lines = [f"collective trace: the ranks disagree at call #{self.index}:"]
        for r, c in self.calls.items():
            root = "" if c is None or c.get("root") is None else f", root rank {c['root']}"
            what = ("made no such call" if c is None else
                    f"{c['op']}(shape {c['shape']}{root}) at {c['where']}")
            lines.append(f"  rank {r}: {what}")
        for r, c in self.stuck.items():
            lines.append(f"  rank {r} is stuck in {c['op']} (call #{c['i']}) at {c['where']}")
        return "\n".join(lines)


def compare_traces(traces: dict[int, list[dict]]) -> TraceReport:
    """The first call at which the ranks' collective traces disagree in kind, shape or root
    (the src or dst rank a broadcast, reduce, scatter or gather names).

    Shown in lesson 10, §2.
    """
    stuck = {r: t[-1] for r, t in traces.items() if t and not t[-1]["done"]}
    longest = max((len(t) for t in traces.values()), default=0)
    for i in range(longest):
        here = {r: (t[i] if i < len(t) else None) for r, t in traces.items()}
        keys = {None if c is None else (c["op"], tuple(c["shape"] or ()), c.get("root"))
                for c in here.values()}
        if len(keys) > 1:
            return TraceReport(False, i, here, stuck)
    return TraceReport(not stuck, None if not stuck else min(c["i"] for c in stuck.values()),
                       {}, stuck)


# --------------------------------------------------------------------------------------------
# diagnose: run a program on N ranks, bounded, and say what went wrong
# --------------------------------------------------------------------------------------------


@dataclass
class Diagnosis:
    """The outcome of :func:`diagnose`: ``status`` is "ok", "hang" or "failed".

    Shown in lesson 10, §2.
    """

    status: str
    world_size: int
    timeout: float
    results: list | None
    pending: list[int]
    error: str | None
    trace: TraceReport
    stacks: dict[int, list[str]]
    traces: dict[int, list[dict]] = field(default_factory=dict)
    findings: list = field(default_factory=list)   # script_checks.Finding, most serious first
    events: dict[int, list[dict]] = field(default_factory=dict)
    error_where: str | None = None  # a failed script: its file:line where the error was raised

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.trace.ok and not self.findings

    def report(self) -> str:
        if self.status == "ok":
            head = f"finished: all {self.world_size} ranks returned within {self.timeout:g} s"
        elif self.status == "hang":
            head = (f"HANG: rank(s) {', '.join(map(str, self.pending))} of {self.world_size} "
                    f"still running after {self.timeout:g} s (stopped)")
        else:
            head = f"FAILED: {self.error}"
        lines = [head]
        if self.status == "failed":
            from . import script_checks

            known = script_checks.explain_failure(self.error)
            at = f" at {self.error_where}" if self.error_where else ""
            if known:
                lines.append(f"  what to change{at}: {known[0]} — {known[1]}")
            elif at:
                lines.append(f"  raised{at}")
        lines.append(self.trace.message())
        for r, frames in self.stacks.items():
            if r in self.pending and frames:
                lines.append(f"  rank {r}'s Python stack when the time ran out (innermost "
                             f"last): " + " > ".join(frames))
        if any(self.events.values()):  # a script ran under the run-time checks
            lines.extend(self._findings_lines())
        return "\n".join(lines)

    def _findings_lines(self) -> list[str]:
        from . import script_checks

        ends = [e for es in self.events.values() for e in es if e["kind"] == "end"]
        if self.findings:
            out = [f"run-time checks: {len(self.findings)} finding(s), most serious first:"]
            for severity in sorted({f.severity for f in self.findings}):
                out.append(f"  {script_checks.SEVERITY[severity]}:")
                out.extend(f"    {f.line()}" for f in self.findings if f.severity == severity)
            return out
        if self.status != "ok" or len(ends) < self.world_size:
            return ["run-time checks: the run stopped early, so they saw only what ran before "
                    "it stopped: fix the error above and run again"]
        return ["run-time checks: nothing found (samplers and set_epoch, loaders, saves, "
                "barriers, all_reduces nothing reads, printed losses and metrics writers, "
                "replicas after the first step, clean-up)"]


def user_frames(dump: str) -> list[str]:
    """file:line (function) of the frames outside torch, the course's plumbing and
    multiprocessing in a ``faulthandler`` dump, outermost first: the main thread's, named by
    the ``# main thread: 0x...`` line :func:`diagnose_worker` writes first (the rank's other
    Python threads, launch's watcher among them, wait elsewhere); without that line, the first
    thread that has any. Shown in lesson 10, §2.
    """
    blocks = dump.split("\n\n")
    main = re.search(r"^# main thread: (0x[0-9a-fA-F]+)", dump, re.M)
    if main:
        ident = int(main.group(1), 16)
        mine = [b for b in blocks
                if (head := re.search(r"hread (0x[0-9a-fA-F]+)", b)) and int(head.group(1), 16)
                == ident]
        blocks = mine or blocks
    for block in blocks:
        out = []
        for line in block.splitlines():
            line = line.strip()
            if not line.startswith('File "') or '", line ' not in line:
                continue
            fname = line.split('"')[1]
            if any(s in fname for s in _SKIP_FRAMES) or "multiprocessing" in fname or fname == "<string>":
                continue
            lineno, _, func = line.split('", line ')[1].partition(" in ")
            out.append(f"{Path(fname).name}:{lineno} ({func})")
        if out:
            return list(reversed(out))
    return []


def diagnose_worker(rank, world_size, target, args, tracedir, dump_after, debug_detail,
                    backend, monitor=None, group_timeout=None, cpu=False):
    """One rank of :func:`diagnose`: set up the group (with DETAIL debugging or a group timeout
    if asked), arm a stack dump ``dump_after`` seconds ahead, and run ``target`` (a worker or a
    script) under the collective trace, written to ``tracedir``. A script also runs under the
    run-time checks of :mod:`dpcourse.script_checks` (``cpu``: NCCL and CUDA calls kept on the
    CPU, for a GPU-only script on a machine without GPUs).

    Shown in lesson 10, §2.
    """
    import datetime

    import torch.distributed as dist

    if debug_detail:  # before the group exists: DETAIL wraps the group when it is created
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    if backend is not None:
        extra = ({} if group_timeout is None else
                 {"timeout": datetime.timedelta(seconds=group_timeout)})
        dist.init_process_group(backend, rank=rank, world_size=world_size, **extra)
    stack_file = open(Path(tracedir) / f"rank{rank}.stack", "w")
    # which of the dumped threads is the one running the target (user_frames reads it)
    stack_file.write(f"# main thread: {threading.main_thread().ident:#x}\n")
    stack_file.flush()
    faulthandler.dump_traceback_later(dump_after, exit=False, file=stack_file)
    try:
        with trace_collectives(Path(tracedir) / f"rank{rank}.trace", monitor=monitor):
            if isinstance(target, str):
                import runpy

                from . import script_checks

                sys.argv = [target, *map(str, args)]
                watch = script_checks.Watch(Path(tracedir) / f"rank{rank}.events", rank,
                                            world_size)
                fallback = script_checks.cpu_fallback() if cpu else contextlib.nullcontext()
                with fallback, watch.installed():
                    runpy.run_path(target, run_name="__main__")
                return None
            return target(rank, world_size, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()


def diagnose(target: Callable | str, world_size: int = 2, *args: Any, timeout: float = 5.0,
             backend: str | None = "gloo", debug_detail: bool = False,
             monitor: float | None = None, group_timeout: float | None = None,
             cpu: bool = False) -> Diagnosis:
    """Run ``target`` on ``world_size`` ranks for at most ``timeout`` seconds and say what went
    wrong. ``target`` is a worker function ``fn(rank, world_size, *args)`` (with ``backend``,
    the process group is set up first, as in ``launch.spawn``) or the path of a torchrun-style
    script (it reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and calls
    ``init_process_group`` itself; ``args`` become its ``sys.argv``). Every rank records its
    collectives and dumps its Python stack shortly before the time limit; nothing is left
    running. ``debug_detail`` turns on TORCH_DISTRIBUTED_DEBUG=DETAIL in the ranks;
    ``monitor`` puts a ``dist.monitored_barrier`` of that many seconds before each collective
    (see :func:`trace_collectives`); ``group_timeout`` is the process group's ``timeout`` in
    seconds (worker functions only: a script sets up its own group). A script also runs under
    :mod:`dpcourse.script_checks`' run-time checks, whose findings land in ``findings``;
    ``cpu`` runs a GPU-only script on the CPU (:func:`dpcourse.script_checks.cpu_fallback`).

    Shown in lesson 10, §2.
    """
    from dpcourse import launch, script_checks

    if isinstance(target, (str, os.PathLike)):
        target = str(Path(target).resolve())
        if not Path(target).exists():
            raise FileNotFoundError(f"diagnose: no such script {target}")
        backend = None
    tracedir = tempfile.mkdtemp(prefix="dpcourse-diagnose-")
    # well before the limit: a rank may start a second after the parent's clock did
    dump_after = max(0.5, min(timeout * 0.6, timeout - 1.5))
    results, pending, error, status, error_where = None, [], None, "ok", None
    try:
        try:
            results = launch.spawn(diagnose_worker, world_size, target, tuple(args), tracedir,
                                   dump_after, debug_detail, backend, monitor,
                                   group_timeout, cpu, timeout=timeout,
                                   show_output=False)
        except launch.LaunchTimeoutError as e:
            status, pending = "hang", list(e.pending)
        except launch.RankFailedError as e:
            status, error = "failed", f"rank {e.rank}: {e.summary}"
            pending = sorted(set(range(world_size)) - set(e.failures))
            if isinstance(target, str):
                error_where = script_checks.failure_line(e.failures.get(e.rank, ""), target)
        traces = read_traces(tracedir, world_size)
        events = script_checks.read_events(tracedir, world_size)
        findings = (script_checks.analyze(events, world_size, script=target)
                    if isinstance(target, str) else [])
        stacks = {}
        for r in range(world_size):
            p = Path(tracedir) / f"rank{r}.stack"
            stacks[r] = user_frames(p.read_text(errors="replace")) if p.exists() else []
    finally:
        shutil.rmtree(tracedir, ignore_errors=True)
    return Diagnosis(status, world_size, timeout, results, pending, error,
                     compare_traces(traces), stacks, traces, findings, events, error_where)


# --------------------------------------------------------------------------------------------
# Replicas that should be equal
# --------------------------------------------------------------------------------------------


def state_checksums(model, grads: bool = False, chunk: int = 1 << 20) -> dict[str, float]:
    """{name: checksum} of every parameter and buffer (or, with ``grads``, every gradient).
    A checksum is the float64 sum of the tensor's values weighted by 1, 2, 3 ... so that two
    tensors with the same sum but values in other places differ too. It is computed on the
    tensor's own device (the CPU for MPS, which has no float64), ``chunk`` elements at a time,
    so its float64 temporaries stay below about 24 bytes x ``chunk`` however large the tensor;
    one ``.item()`` per tensor brings the sum back. Send the dict back from each rank and give
    the list to :func:`compare_checksums`. Equal bits give equal checksums when every rank sums
    the same way (the same device type and thread count). Lab 10's stretch asks for a detector
    of your own, ``replicas_in_sync(model)``.

    Shown in lesson 10, §3.
    """
    import torch

    out = {}
    items = ([(n, p.grad) for n, p in model.named_parameters() if p.grad is not None] if grads
             else list(model.named_parameters()) + list(model.named_buffers()))
    for name, t in items:
        flat = t.detach().flatten()
        device = torch.device("cpu") if flat.device.type == "mps" else flat.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk].to(device=device, dtype=torch.float64)
            weights = torch.arange(start + 1, start + part.numel() + 1, dtype=torch.float64,
                                   device=device)
            total += (part * weights).sum()
        out[name] = float(total)
    return out


def compare_checksums(per_rank: Sequence[dict[str, float]], rtol: float = 0.0) -> list[str]:
    """Names of the tensors whose checksums differ between ranks (empty: the replicas agree).
    A non-finite checksum on any rank counts as a difference. By default (``rtol=0``) any
    difference counts: replicas kept in sync are bit-identical (lesson 03), so their checksums
    are equal; ``rtol`` > 0 tolerates a difference up to ``rtol`` x max(1, |checksum|), for
    checksums summed in different orders (on different devices, in other chunks).

    Shown in lesson 10, §3.
    """
    differ = []
    for name in per_rank[0]:
        vals = [c.get(name, math.nan) for c in per_rank]
        if not all(math.isfinite(v) for v in vals):
            differ.append(name)
            continue
        scale = max(1.0, max(abs(v) for v in vals))
        if max(vals) - min(vals) > rtol * scale:
            differ.append(name)
    return differ


def first_nonfinite(per_rank_values: Sequence[Sequence[float]]) -> tuple[int, list[int]] | None:
    """``per_rank_values[r][s]``: a value rank r computed *locally* at step s, before any
    all-reduce (its loss, its gradient norm). Returns (the first step where a value is NaN or
    inf, the ranks where it is) — the origin, not the ranks it spread to — or None.

    Shown in lesson 10, §3.
    """
    steps = max(len(v) for v in per_rank_values)
    for s in range(steps):
        bad = [r for r, v in enumerate(per_rank_values) if s < len(v) and not math.isfinite(v[s])]
        if bad:
            return s, bad
    return None


def repeated_epoch_orders(orders: Sequence[Sequence[int]]) -> list[int]:
    """``orders[e]``: the sample indices one rank saw in epoch e. The epochs (after the first)
    whose order equals epoch 0's: with shuffling on, a sign that ``sampler.set_epoch`` is
    missing (DistributedSampler seeds its shuffle with seed + epoch).

    Shown in lesson 10, §3.
    """
    return [e for e in range(1, len(orders)) if list(orders[e]) == list(orders[0])]


def unused_parameters(model, *inputs) -> list[str]:
    """Names of the parameters that get no gradient from one forward/backward of ``model`` on
    ``inputs`` (summing the outputs): what makes DDP fail with "Expected to have finished
    reduction". Runs in one process, no DDP needed; the gradients are cleared afterwards.

    Shown in lesson 10, §3.
    """
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    outs = out if isinstance(out, (tuple, list)) else [out]
    sum(o.float().sum() for o in outs).backward()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    return unused


@contextlib.contextmanager
def record_saves(rank: int, records: list):
    """Within the block, each ``torch.save(obj, path)`` appends ``(rank, path)`` to
    ``records``. Send the list back from every rank and give them to :func:`duplicate_writers`.

    Shown in lesson 10, §3.
    """
    import torch

    original = torch.save

    def spy(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            records.append((rank, os.path.abspath(f)))
        return original(obj, f, *args, **kwargs)

    torch.save = spy
    try:
        yield records
    finally:
        torch.save = original


def duplicate_writers(per_rank_records: Sequence[Sequence[tuple[int, str]]]) -> dict[str, list[int]]:
    """{path: ranks} for every file that more than one rank wrote (empty: no clash).

    Shown in lesson 10, §3.
    """
    writers: dict[str, set] = {}
    for recs in per_rank_records:
        for rank, path in recs:
            writers.setdefault(path, set()).add(rank)
    return {p: sorted(r) for p, r in writers.items() if len(r) > 1}


def port_owner(port: int, host: str = "127.0.0.1") -> dict | None:
    """None if ``port`` is free on ``host``; otherwise what is known about who listens on it
    ({"port", "pid", "name", "cmdline"}; pid None when the OS will not say).

    Shown in lesson 10, §4.
    """
    import socket

    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return None
        except OSError:
            pass
    info: dict[str, Any] = {"port": port, "pid": None, "name": None, "cmdline": None}
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                p = psutil.Process(c.pid)
                info.update(pid=c.pid, name=p.name(), cmdline=" ".join(p.cmdline())[:200])
                break
    except (psutil.Error, PermissionError):
        pass
    return info
