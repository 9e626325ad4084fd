"""``python -m dpcourse workshop-check --learners N``: rehearse a classroom on this machine.

On a shared workshop server many learners press "run" at the same moment. Lessons 03 and 04
then start ranks from a notebook (:func:`dpcourse.launch.spawn`) and torchrun jobs
(:func:`dpcourse.launch.torchrun`) all at once. This check does exactly that for ``N``
pretend learners, each in a process of its own with the settings an instructor would give
that learner, and proves three things an instructor cares about before the room fills up:

* **no port clash** — every launch got its own rendezvous port and every launch finished;
* **no orphan** — when the learners are done, no process any of them started is still alive
  (found by a tag in the environment, which survives re-parenting and torchrun's new
  sessions) and none of their ports is still bound;
* **how long** each learner waited, with N of them sharing the machine.

It also prints the per-learner settings for this machine: a ``CUDA_VISIBLE_DEVICES`` slice
per learner when there are GPUs, ``OMP_NUM_THREADS`` so that N learners' ranks do not
oversubscribe the cores, and ``DPCOURSE_PROFILE`` (see :mod:`dpcourse.devices`). Put them in
each learner's JupyterHub spawner environment (or their shell) before the workshop.

    python -m dpcourse workshop-check --learners 4            # run the rehearsal
    python -m dpcourse workshop-check --learners 20 --plan    # only print the settings
    python -m dpcourse workshop-check --learners 4 --json     # for scripts

The instructor guide (lessons/INSTRUCTOR_GUIDE.md) says when to run it.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Every process a pretend learner starts carries this variable (value: run id and learner),
# so that its leftovers can be found wherever they were re-parented.
TAG = "DPCOURSE_WORKSHOP_TAG"
TRAIN_DDP = Path(__file__).resolve().parents[1] / "scripts" / "train_ddp.py"


@dataclass
class LearnerSettings:
    """The environment one learner gets, and why."""

    learner: int
    env: dict[str, str]
    note: str = ""


def learner_settings(learners: int, gpu_count: int, cpu_count: int,
                     ranks: int = 2) -> list[LearnerSettings]:
    """Settings for ``learners`` learners on a machine with ``gpu_count`` GPUs and
    ``cpu_count`` cores, each running up to ``ranks`` processes at once.

    GPUs: with at least one per learner, each learner gets a contiguous slice of
    ``gpu_count // learners`` (2 or more: the multi-gpu profile, NCCL; exactly 1: one-gpu).
    With fewer GPUs than learners, or none, everyone gets the cpu profile and an empty
    ``CUDA_VISIBLE_DEVICES`` (so a CUDA build of torch does not go looking): the same course
    for every learner, rather than some on GPUs and several kernels sharing one GPU's memory.

    Threads: every rank's PyTorch would start one thread per core; N learners × ``ranks``
    ranks would then fight over the cores, so each rank gets ``cpu_count // (N × ranks)``
    threads, at least 1.
    """
    if not isinstance(learners, int) or learners < 1:
        raise ValueError(f"--learners must be at least 1, got {learners!r}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--ranks must be at least 1, got {ranks!r}")
    threads = max(1, cpu_count // (learners * ranks))
    out = []
    for i in range(learners):
        env = {"OMP_NUM_THREADS": str(threads)}
        if gpu_count == 0:
            env.update(CUDA_VISIBLE_DEVICES="", DPCOURSE_PROFILE="cpu")
            note = "no GPU: gloo ranks on the CPU"
        elif gpu_count >= learners:
            per = gpu_count // learners
            gpus = range(i * per, (i + 1) * per)
            env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)),
                       DPCOURSE_PROFILE="multi-gpu" if per >= 2 else "one-gpu")
            note = (f"{per} GPUs of its own: NCCL, one GPU per rank" if per >= 2
                    else "one GPU of its own: multi-rank lessons use gloo")
            if i == learners - 1 and gpu_count % learners:
                note += f" ({gpu_count % learners} GPU(s) left for the instructor)"
        else:
            # Fewer GPUs than learners: everyone on the CPU profile rather than some learners
            # on GPUs and some not, or several kernels fighting over one GPU's memory; the
            # lessons give the same checked results on the CPU.
            env.update(CUDA_VISIBLE_DEVICES="", DPCOURSE_PROFILE="cpu")
            note = (f"{gpu_count} GPU(s) for {learners} learners: everyone on the cpu profile "
                    f"(GPUs need one per learner)")
        out.append(LearnerSettings(i, env, note))
    return out


# --------------------------------------------------------------------------------------------
# One pretend learner: what lessons 03 and 04 launch, timed. Runs in its own process.
# --------------------------------------------------------------------------------------------


def _ddp_steps(rank: int, world_size: int, steps: int = 3) -> dict:
    """A few DDP steps on a tiny model (lesson 03's worker, shortened): returns this rank's
    rendezvous port and a checksum of its weights, which must agree across ranks."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        X, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    dist.barrier()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"port": int(os.environ["MASTER_PORT"]), "checksum": checksum}


def run_learner(learner: int, ranks: int = 2, timeout: float = 120.0) -> dict:
    """Do what one learner's notebooks do in lessons 03 and 04: an in-notebook launch of
    ``ranks`` DDP ranks, then a torchrun job of the lesson 04 script. Returns times and ports."""
    from dpcourse import launch

    record = {"learner": learner, "ok": False, "error": None, "ports": []}
    start = time.monotonic()
    try:
        results = launch.spawn(_ddp_steps, ranks, backend="gloo", timeout=timeout,
                               show_output=False)
        record["spawn_s"] = round(time.monotonic() - start, 2)
        if len({r["checksum"] for r in results}) != 1:
            raise RuntimeError("ranks of one launch ended with different weights")
        record["ports"].append(results[0]["port"])
        t = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="dpcourse-workshop-") as tmp:
            res = launch.torchrun(TRAIN_DDP, "--epochs", "1", "--n-train", "64",
                                  "--per-rank-batch", "8", "--out", os.path.join(tmp, "w.pt"),
                                  nproc_per_node=ranks, timeout=timeout, echo=False,
                                  check=False, cwd=tmp)
            if res.returncode != 0 or not os.path.exists(os.path.join(tmp, "w.pt")):
                tail = " | ".join(res.output.strip().splitlines()[-3:])
                raise RuntimeError(f"torchrun exited with {res.returncode}: {tail}")
        endpoint = next(a for a in res.command if a.startswith("--rdzv-endpoint="))
        record["ports"].append(int(endpoint.rsplit(":", 1)[1]))
        record["torchrun_s"] = round(time.monotonic() - t, 2)
        record["ok"] = True
    except Exception as exc:  # reported by the parent, per learner, in one line
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    record["total_s"] = round(time.monotonic() - start, 2)
    return record


# --------------------------------------------------------------------------------------------
# The instructor's side: start N learners at once, then look for clashes and leftovers.
# --------------------------------------------------------------------------------------------


@dataclass
class WorkshopReport:
    learners: int
    settings: list[LearnerSettings]
    records: list[dict] = field(default_factory=list)
    duplicate_ports: list[int] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    bound_ports: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (len(self.records) == self.learners and all(r["ok"] for r in self.records)
                and not self.duplicate_ports and not self.orphans and not self.bound_ports)


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


def workshop_check(learners: int, ranks: int = 2, timeout: float = 180.0,
                   gpu_count: int | None = None) -> WorkshopReport:
    """Start ``learners`` pretend learners at once and check for clashes and leftovers."""
    from dpcourse import launch

    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    settings = learner_settings(learners, gpu_count, os.cpu_count() or 1, ranks)
    report = WorkshopReport(learners, settings)
    run_id = uuid.uuid4().hex[:12]
    lib = str(Path(__file__).resolve().parents[2])
    procs = []
    start = time.monotonic()
    try:
        for s in settings:
            env = dict(os.environ, **s.env)
            env[TAG] = f"{run_id}-{s.learner}"
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [lib, env.get("PYTHONPATH")]))
            env.pop("MASTER_PORT", None)  # a fixed port is exactly what would clash
            cmd = [sys.executable, "-m", "dpcourse.tools.workshop", "--as-learner", str(s.learner),
                   "--ranks", str(ranks), "--timeout", str(timeout)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout + 30
        for s, p in zip(settings, procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                lines = out.strip().splitlines()
                record = json.loads(lines[-1]) if lines else None
            except subprocess.TimeoutExpired:
                launch.kill_tree(p.pid)
                p.communicate()
                record, err = None, f"did not finish within {timeout + 30:g} s"
            except json.JSONDecodeError:
                record = None
            if record is None:
                tail = (err or "").strip().splitlines()[-1:] or ["no output"]
                record = {"learner": s.learner, "ok": False, "error": tail[0], "ports": []}
            report.records.append(record)
    finally:
        for p in procs:
            if p.poll() is None:
                launch.kill_tree(p.pid)
                p.communicate()
    report.wall_s = round(time.monotonic() - start, 2)
    ports = [port for r in report.records for port in r["ports"]]
    report.duplicate_ports = duplicate_ports(report.records)
    # Give exiting ranks a moment (a rank that was just killed is not gone at once).
    settle = time.monotonic() + 5
    while time.monotonic() < settle and (tagged_processes(run_id)
                                         or any(port_is_bound(p) for p in ports)):
        time.sleep(0.2)
    report.orphans = tagged_processes(run_id)
    report.bound_ports = [p for p in ports if port_is_bound(p)]
    return report


def format_settings(settings: list[LearnerSettings]) -> str:
    """One line per learner, ready to paste into that learner's environment."""
    lines = []
    for s in settings:
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(s.env.items()))
        lines.append(f"learner {s.learner}: export {assignments}   # {s.note}")
    lines.append("MASTER_PORT stays unset: every launch picks a free port of its own.")
    return "\n".join(lines)


def duplicate_ports(records: list[dict]) -> list[int]:
    """Ports that more than one launch used (a clash), from the learners' records."""
    ports = [port for r in records for port in r["ports"]]
    return sorted({p for p in ports if ports.count(p) > 1})


def format_report(report: WorkshopReport) -> str:
    lines = [f"dpcourse workshop-check: {report.learners} learners at once, "
             f"{report.wall_s:.1f} s in all", "", format_settings(report.settings), "",
             "learner  in-notebook launch  torchrun  total  ports         result"]
    for r in report.records:
        result = "ok" if r["ok"] else f"FAILED: {r['error']}"
        spawn_s, torchrun_s, total_s = (f"{r[k]:.1f}s" if k in r else "-"
                                        for k in ("spawn_s", "torchrun_s", "total_s"))
        lines.append(f"{r['learner']:>7}  {spawn_s:>18}  {torchrun_s:>8}  {total_s:>5}  "
                     f"{','.join(map(str, r['ports'])):<12}  {result}")
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
        "workshop check passed" if report.ok else "workshop check FAILED",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m dpcourse workshop-check`` (and of one pretend learner)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dpcourse workshop-check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="ranks per learner launch")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per learner")
    p.add_argument("--plan", action="store_true", help="print the settings, run nothing")
    p.add_argument("--json", action="store_true")
    p.add_argument("--as-learner", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.learners < 1:
        p.error(f"--learners must be at least 1, got {args.learners}")
    if args.ranks < 1:
        p.error(f"--ranks must be at least 1, got {args.ranks}")
    if args.timeout <= 0:
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.as_learner is not None:
        print(json.dumps(run_learner(args.as_learner, args.ranks, args.timeout)))
        return 0
    if args.plan:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        settings = learner_settings(args.learners, gpus, os.cpu_count() or 1, args.ranks)
        if args.json:
            print(json.dumps([asdict(s) for s in settings], indent=1))
        else:
            print(f"{args.learners} learners on {gpus} GPU(s) and {os.cpu_count()} core(s)")
            print(format_settings(settings))
        return 0
    report = workshop_check(args.learners, args.ranks, args.timeout)
    if args.json:
        print(json.dumps(asdict(report) | {"ok": report.ok}, indent=1))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
