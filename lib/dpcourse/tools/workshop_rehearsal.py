"""The workshop rehearsal (``python -m dpcourse workshop-check`` without ``--plan``): N pretend
learners at once, each a process with its seat's environment, running what lessons 03, 04, 06
and lab03 launch; then the checks an instructor needs before the room fills (ports, leftovers,
threads). What it proves and why is in :mod:`dpcourse.tools.workshop`'s docstring.

One pretend learner (:func:`run_learner`) runs in its own process; the instructor's side
(:func:`workshop_check`) starts them, collects their records and looks for clashes, orphans,
bound ports and oversubscription (:class:`WorkshopReport`, :func:`format_report`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from dpcourse.tools.workshop import (LIB, MAX_RANKS, LearnerSettings, _positive,
                                     format_settings, learner_settings, machine, parse_cpus)

# Every process a pretend learner starts carries this variable (value: run id and learner),
# so that its leftovers can be found wherever they were re-parented.
TAG = "DPCOURSE_WORKSHOP_TAG"
TRAIN_DDP = LIB / "scripts" / "train_ddp.py"


# --------------------------------------------------------------------------------------------
# One pretend learner: what lessons 03, 04, 06 and lab03 launch, timed. Its own process.
# --------------------------------------------------------------------------------------------


def measured(rank: int, world_size: int, worker, *args, **kwargs) -> dict:
    """Run ``worker(rank, world_size, *args)`` as a lesson does, then report what this rank ran
    with: its result, its torch intra-op threads (after the worker's own setup), the cores it
    may run on, and its rendezvous port."""
    import torch

    from dpcourse import devices

    result = worker(rank, world_size, *args, **kwargs)
    cores = devices.usable_cores()
    return {"result": result, "threads": torch.get_num_threads(), "cores": cores,
            "port": int(os.environ["MASTER_PORT"])}


def _launch_record(step: str, results: list[dict], seconds: float) -> dict:
    return {"step": step, "ranks": len(results), "threads": max(r["threads"] for r in results),
            "cores": min(r["cores"] for r in results), "port": results[0]["port"],
            "s": round(seconds, 2)}


def _lesson03(timeout: float) -> tuple[dict, list[dict]]:
    """Lesson 03's DDP launch (its cell ``launch.spawn(ddp.ddp_worker, ...)``, with the lesson's
    parameters) and its check against one process on the global batch."""
    import torch

    from dpcourse import ddp, devices, launch

    world_size = 2
    cfg = ddp.StepConfig(global_batch=32, steps=10, lr=0.05, width=8, seed=0)
    start = time.monotonic()
    out = launch.spawn(measured, world_size, ddp.ddp_worker, cfg,
                       backend=devices.backend_for(world_size), timeout=timeout,
                       show_output=False)
    record = _launch_record("lesson 03's DDP launch (ddp.ddp_worker)", out, time.monotonic() - start)
    single = ddp.single_process(cfg)
    diff = max(float((r["result"]["params"].cpu() - single["params"]).abs().max()) for r in out)
    if not diff < 1e-5:
        raise RuntimeError(f"lesson 03: DDP's weights differ from one process by {diff:.1e}")
    if not all(torch.equal(out[0]["result"]["params"], r["result"]["params"]) for r in out):
        raise RuntimeError("lesson 03: the ranks ended with different weights")
    return record, out


def _a_learners_average_gradients(model) -> None:
    """What a learner writes in lab 03's first cell (the check refuses the library's own)."""
    import torch.distributed as dist

    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    # which parameters got a gradient on some rank: no rank can tell alone
    used = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(used)
    for p, n in zip(params, used.tolist()):
        if n == 0:
            continue          # no rank used it: p.grad stays None, as one process leaves it
        if p.grad is None:    # used elsewhere, not here: this rank contributes zeros
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _lab03(timeout: float) -> dict:
    """Lab 03's first check, on a right answer written as a learner would."""
    import contextlib
    import io

    from dpcourse.checks import lab03

    start = time.monotonic()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        lab03.check_average_gradients(_a_learners_average_gradients, timeout=timeout)
    if "✔" not in text.getvalue():
        raise RuntimeError(f"lab03's check printed no ✔: {text.getvalue().strip()[:200]}")
    return {"step": "lab03's check (2 and 3 ranks)", "s": round(time.monotonic() - start, 2)}


def _lesson04(timeout: float) -> dict:
    """Lesson 04's torchrun job: the course's DDP training script, one short epoch."""
    from dpcourse import launch

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dpcourse-workshop-") as tmp:
        res = launch.torchrun(TRAIN_DDP, "--epochs", "1", "--n-train", "64",
                              "--per-rank-batch", "8", "--out", os.path.join(tmp, "w.pt"),
                              nproc_per_node=2, timeout=timeout, echo=False,
                              check=False, cwd=tmp)
        if res.returncode != 0 or not os.path.exists(os.path.join(tmp, "w.pt")):
            tail = " | ".join(res.output.strip().splitlines()[-3:])
            raise RuntimeError(f"torchrun exited with {res.returncode}: {tail}")
    endpoint = next(a for a in res.command if a.startswith("--rdzv-endpoint="))
    return {"step": "lesson 04's torchrun job (train_ddp.py)", "ranks": 2,
            "port": int(endpoint.rsplit(":", 1)[1]), "s": round(time.monotonic() - start, 2)}


def _lesson06(timeout: float, ranks: int = MAX_RANKS) -> dict:
    """Lesson 06's alpha-beta measurement (``bench.measure_allreduce`` on 4 ranks, as its fit
    cell starts it), on three sizes instead of eight: the same ranks and threads, less time."""
    from dpcourse import bench, launch

    start = time.monotonic()
    out = launch.spawn(measured, ranks, bench.measure_allreduce, [1024, 64 * 1024, 1024 * 1024],
                       2, 1, max_reps=4, backend="gloo", timeout=timeout, show_output=False)
    return _launch_record(f"lesson 06's alpha-beta fit ({ranks} ranks, bench.measure_allreduce)",
                          out, time.monotonic() - start)


STEPS = ("03", "lab03", "04", "06")  # what a learner runs, in the plan's order


def run_learner(learner: int, timeout: float = 120.0, ranks: int = MAX_RANKS,
                steps=STEPS) -> dict:
    """Do what one learner's notebooks launch in lessons 03, 04, 06 and lab03 (``steps``: some
    of :data:`STEPS`), one after the other as the plan has them; returns each launch's time,
    ranks, threads and port."""
    import torch

    record = {"learner": learner, "ok": False, "error": None, "ports": [], "launches": [],
              "kernel_threads": torch.get_num_threads()}  # as OMP_NUM_THREADS left it
    start = time.monotonic()
    run = {"03": lambda: _lesson03(timeout)[0], "lab03": lambda: _lab03(timeout),
           "04": lambda: _lesson04(timeout), "06": lambda: _lesson06(timeout, ranks)}
    try:
        for step in steps:
            record["launches"].append(run[step]())
        record["ports"] = [r["port"] for r in record["launches"] if "port" in r]
        record["ok"] = True
    except Exception as exc:  # reported by the parent, per learner, in one line
        record["ports"] = [r["port"] for r in record["launches"] if "port" in r]
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    record["total_s"] = round(time.monotonic() - start, 2)
    return record


# --------------------------------------------------------------------------------------------
# The instructor's side: start N learners at once, then look for clashes, leftovers and
# oversubscription.
# --------------------------------------------------------------------------------------------


@dataclass
class WorkshopReport:
    learners: int
    settings: list[LearnerSettings]
    records: list[dict] = field(default_factory=list)
    duplicate_ports: list[int] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    bound_ports: list[int] = field(default_factory=list)
    oversubscribed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    steps: tuple = STEPS

    @property
    def ok(self) -> bool:
        return (len(self.records) == self.learners and all(r["ok"] for r in self.records)
                and not self.duplicate_ports and not self.orphans and not self.bound_ports
                and not self.oversubscribed)


def oversubscription(records: list[dict], settings: list[LearnerSettings],
                     cpu_count: int) -> tuple[list[str], list[str]]:
    """(failures, notes) from what the learners' ranks reported.

    A failure, one sentence each: a launch whose ranks × threads exceed the learner's cores
    while a rank runs more than one thread (fewer threads would fit), or a learner's kernel
    with more threads than the learner's cores. A note: ranks that outnumber the learner's
    cores at one thread each (no setting removes that), and the peak over the machine."""
    failures, notes = [], []
    seats = {s.learner: s for s in settings}
    seen_notes = set()
    peak = 0
    for r in records:
        seat = seats.get(r["learner"])
        if seat is None:
            continue
        cores, threads_env = seat.cores, seat.env.get("OMP_NUM_THREADS", "?")
        who = f"learner {r['learner']} ({cores} core(s) of {cpu_count})"
        kernel = r.get("kernel_threads")
        if kernel and kernel > cores:
            failures.append(f"{who}: the kernel runs {kernel} threads on {cores} core(s) — "
                            f"OMP_NUM_THREADS={threads_env} is more than the learner's cores.")
        for launch in r.get("launches", []):
            if "threads" not in launch:
                continue
            ranks, threads = launch["ranks"], launch["threads"]
            peak = max(peak, ranks * threads)
            if threads > 1 and ranks * threads > cores:
                failures.append(f"{who}, {launch['step']}: {ranks} ranks × {threads} threads = "
                                f"{ranks * threads} threads on {cores} core(s) — oversubscribed; "
                                f"each rank should run at most {max(1, cores // ranks)} "
                                f"(OMP_NUM_THREADS={threads_env} in the plan).")
            elif ranks > cores and launch["step"] not in seen_notes:
                seen_notes.add(launch["step"])
                notes.append(f"{launch['step']}: {ranks} ranks take turns on a learner's "
                             f"{cores} core(s), one thread each (no setting removes that).")
    if records and peak:
        total = peak * len(records)
        notes.append(f"at the peak, {len(records)} learners × {peak} busy threads = {total} "
                     f"on {cpu_count} core(s)" + ("" if total <= cpu_count else
                                                   " — if they all launch at the same moment"))
    return failures, notes


def tagged_processes(run_id: str) -> list[str]:
    """Processes (pid and command) whose environment carries this run's tag."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get(TAG, "").startswith(run_id):
                found.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:100]}")
        except (psutil.Error, OSError):
            continue  # gone, a zombie, or another user's process
    return found


def port_is_bound(port: int) -> bool:
    """True if something still listens on 127.0.0.1:``port`` (TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _pin(cpus: str):
    """A preexec_fn pinning the child to ``cpus`` (what the hub does with taskset)."""
    wanted = parse_cpus(cpus)

    def preexec() -> None:
        if wanted and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, wanted & os.sched_getaffinity(0) or wanted)

    return preexec


def workshop_check(learners: int, timeout: float = 180.0, gpu_count: int | None = None,
                   cpu_count: int | None = None, threads: int | None = None,
                   ranks: int = MAX_RANKS, steps=STEPS) -> WorkshopReport:
    """Start ``learners`` pretend learners at once, each with its seat's environment (and
    ``OMP_NUM_THREADS=threads`` when given, to try another setting), and check for clashes,
    leftovers and oversubscription."""
    from dpcourse import launch

    gpu_count, machine_cores, _ = machine(gpu_count, None, 1.0)
    cpu_count = cpu_count or machine_cores
    settings = learner_settings(learners, gpu_count, cpu_count, ranks)
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise ValueError(f"steps must be some of {', '.join(STEPS)}, got {list(steps)}")
    if threads is not None:
        _positive("threads", threads)
        for s in settings:
            s.env["OMP_NUM_THREADS"] = str(threads)
    report = WorkshopReport(learners, settings, steps=tuple(steps))
    run_id = uuid.uuid4().hex[:12]
    procs = []
    start = time.monotonic()
    try:
        for s in settings:
            env = dict(os.environ, **s.env)
            env[TAG] = f"{run_id}-{s.learner}"
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIB.parent),
                                                              env.get("PYTHONPATH")]))
            env.pop("MASTER_PORT", None)  # a fixed port is exactly what would clash
            env.pop("DPCOURSE_PROGRESS", None)  # pretend learners stay out of the class table
            cmd = [sys.executable, "-m", "dpcourse.tools.workshop", "--as-learner",
                   str(s.learner), "--timeout", str(timeout), "--max-ranks", str(ranks),
                   *(a for step in steps for a in ("--only", step))]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True,
                                          start_new_session=True, preexec_fn=_pin(s.cpus)))
        # Each launch inside a learner is bounded by ``timeout``; this outer bound only catches a
        # learner process that is stuck outside a launch. It allows for starting Python and
        # importing torch, which took 30 s and more on a 2-core machine at load 14.
        grace = 180
        deadline = time.monotonic() + len(steps) * timeout + grace
        for s, p in zip(settings, procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                lines = out.strip().splitlines()
                record = json.loads(lines[-1]) if lines else None
            except subprocess.TimeoutExpired:
                launch.kill_tree(p.pid)
                p.communicate()
                record, err = None, f"did not finish within {len(steps) * timeout + grace:g} s"
            except json.JSONDecodeError:
                record = None
            if record is None:
                tail = (err or "").strip().splitlines()[-1:] or ["no output"]
                record = {"learner": s.learner, "ok": False, "error": tail[0], "ports": [],
                          "launches": []}
            report.records.append(record)
    finally:
        for p in procs:
            if p.poll() is None:
                launch.kill_tree(p.pid)
                p.communicate()
    report.wall_s = round(time.monotonic() - start, 2)
    ports = [port for r in report.records for port in r["ports"]]
    report.duplicate_ports = duplicate_ports(report.records)
    report.oversubscribed, report.notes = oversubscription(report.records, settings, cpu_count)
    # Give exiting ranks a moment (a rank that was just killed is not gone at once).
    settle = time.monotonic() + 5
    while time.monotonic() < settle and (tagged_processes(run_id)
                                         or any(port_is_bound(p) for p in ports)):
        time.sleep(0.2)
    report.orphans = tagged_processes(run_id)
    report.bound_ports = [p for p in ports if port_is_bound(p)]
    return report


def duplicate_ports(records: list[dict]) -> list[int]:
    """Ports that more than one launch used (a clash), from the learners' records."""
    ports = [port for r in records for port in r["ports"]]
    return sorted({p for p in ports if ports.count(p) > 1})


_STEP_NAMES = {"03": "lesson 03", "lab03": "lab03", "04": "lesson 04", "06": "lesson 06"}


def format_report(report: WorkshopReport) -> str:
    lines = [f"dpcourse workshop-check: {report.learners} learners at once, "
             f"{report.wall_s:.1f} s in all", "", format_settings(report.settings), "",
             "learner  " + "  ".join(f"{_STEP_NAMES[s]:>9}" for s in report.steps)
             + "   total  threads  result"]
    for r in report.records:
        result = "ok" if r["ok"] else f"FAILED: {r['error']}"
        times = [f"{x['s']:.1f}s" for x in r.get("launches", [])]
        times += ["-"] * (len(report.steps) - len(times))
        threads = "/".join(str(x["threads"]) for x in r.get("launches", []) if "threads" in x)
        lines.append(f"{r['learner']:>7}  " + "  ".join(f"{t:>9}" for t in times)
                     + f"  {r.get('total_s', 0):>5.1f}s  {threads or '-':>7}  {result}")
    n_ports = sum(len(r["ports"]) for r in report.records)
    lines += [
        "",
        ("no port clash: " if not report.duplicate_ports else "PORT CLASH: ")
        + (f"{n_ports} launches on {n_ports} different ports" if not report.duplicate_ports
           else f"ports used twice: {report.duplicate_ports}"),
        ("no orphan: no process left behind" if not report.orphans
         else f"ORPHANS left running: {report.orphans}"),
        ("every port released" if not report.bound_ports
         else f"PORTS STILL BOUND: {report.bound_ports}"),
    ]
    lines += ([f"OVERSUBSCRIBED: {s}" for s in report.oversubscribed]
              or ["no launch oversubscribed by threads"])
    lines += [f"note: {s}" for s in report.notes]
    lines.append("workshop check passed" if report.ok else "workshop check FAILED")
    return "\n".join(lines)
