"""``python -m dpcourse workshop-check``: plan a classroom on a shared server, and rehearse it.

**The plan** (``--plan``) gives every learner a *seat*: the GPUs, cores, threads, memory and
hardware profile that learner's Jupyter server gets. It can be made for a server you are not on
(``--gpus``, ``--cores``, ``--memory``, ``--learners``; each defaults to this machine's), and is
printed as shell exports, as a JupyterHub configuration (``--format jupyterhub``: the same seats
through :func:`configure_hub`, which ``classroom/jupyterhub_config.py`` calls) or as JSON.

* **GPUs.** With two or more GPUs per learner, each learner gets a contiguous slice (the
  ``multi-gpu`` profile: NCCL, one GPU per rank). With fewer, the GPUs still go to learners, in
  seats of two (lesson 03's NCCL demos need two ranks with a GPU each); an odd GPU left over makes
  a ``one-gpu`` seat; every other learner gets the ``cpu`` profile — the lessons give the same
  checked results there.
* **Cores.** Each learner gets ``cores // learners`` cores of their own (a contiguous range the
  hub pins their server to), so no learner's ranks can slow a neighbour's; with fewer cores than
  learners, the learners share them.
* **Threads.** ``OMP_NUM_THREADS`` is the learner's cores divided by the most ranks one learner
  starts at once — 4, lesson 06's α-β fit (``fit_world_sizes = (2, 4)``) — at least 1. With
  fewer than 4 cores per learner that fit's 4 ranks take turns on the learner's own cores (the
  lesson's contention term models exactly that, with C read from the cores the server is pinned
  to): it is slower for that learner, and no one else.

**The rehearsal** (without ``--plan``) starts N pretend learners at the same moment, each a
process with its seat's environment (pinned to its cores), doing what the lessons do with their
real worker functions and the same per-rank setup (``ddp.setup_rank``): lesson 03's DDP launch
(``ddp.ddp_worker`` against ``ddp.single_process``), lab03's check
(``checks.lab03.check_average_gradients``), lesson 04's torchrun job (``scripts/train_ddp.py``)
and lesson 06's α-β measurement on 4 ranks (``bench.measure_allreduce``, smaller sizes). It
then proves what an instructor needs before the room fills: every launch got its own port and
finished; no process any learner started is still alive and no port is bound; and no launch was
oversubscribed by threads — each rank reports the threads it ran with, and ranks × threads
above the learner's cores (with more than one thread per rank) fails the check with a sentence
naming the learner, the launch and the numbers. Ranks that outnumber cores at one thread each
(lesson 06's 4 ranks on a 3-core seat) are reported, not failed: no setting removes them.

    python -m dpcourse workshop-check --plan                                   # this machine
    python -m dpcourse workshop-check --plan --gpus 8 --cores 64 --learners 20
    python -m dpcourse workshop-check --plan --learners 20 --format jupyterhub
    python -m dpcourse workshop-check --learners 4        # the rehearsal, here, 4 at once

The instructor guide (lessons/INSTRUCTOR_GUIDE.md) and classroom/README.md say when to run it.

Where the code is: the plan and this command here; the hub's side (seats kept across restarts,
a copy of the course per learner, the JupyterHub hook) in :mod:`dpcourse.tools.workshop_hub`;
the rehearsal in :mod:`dpcourse.tools.workshop_rehearsal`. Every name of those two is reachable
from here too (``workshop.configure_hub``, as ``classroom/jupyterhub_config.py`` calls it).
"""

from __future__ import annotations

import importlib
import json
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

LIB = Path(__file__).resolve().parents[1]
ROOT = LIB.parents[1]  # the repository (a course checkout)
MAX_RANKS = 4  # the most ranks one learner starts at once: lesson 06's alpha-beta fit
SEAT_GPUS = 2  # a GPU seat below two GPUs per learner: lesson 03's two NCCL ranks
FORMATS = ("exports", "jupyterhub", "json")


# --------------------------------------------------------------------------------------------
# The plan: one seat per learner
# --------------------------------------------------------------------------------------------


@dataclass
class LearnerSettings:
    """One learner's seat: the environment their Jupyter server gets, and why.

    ``cores``: the cores this learner can count on; ``cpus``: the core range their server is
    pinned to ("8-10"; "" when learners share the cores); ``mem_gib``: their memory limit
    (None when unknown)."""

    learner: int
    env: dict[str, str]
    note: str = ""
    cores: int = 1
    cpus: str = ""
    mem_gib: float | None = None


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"--{name} must be at least 1, got {value!r}")


def _span(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def learner_settings(learners: int, gpu_count: int, cpu_count: int, ranks: int = MAX_RANKS,
                     memory_gib: float | None = None) -> list[LearnerSettings]:
    """The seats of ``learners`` learners on a server with ``gpu_count`` GPUs, ``cpu_count``
    cores and ``memory_gib`` GiB, where one learner starts up to ``ranks`` processes at once
    (the rules are in the module docstring)."""
    _positive("learners", learners)
    _positive("ranks", ranks)
    _positive("cores", cpu_count)
    if not isinstance(gpu_count, int) or gpu_count < 0:
        raise ValueError(f"--gpus must be 0 or more, got {gpu_count!r}")
    if memory_gib is not None and memory_gib <= 0:
        raise ValueError(f"--memory must be a positive number of GiB, got {memory_gib!r}")
    own_cores = cpu_count // learners
    cores = max(1, own_cores)
    threads = max(1, cores // ranks)
    # 10% of the memory stays with the system and the hub; the rest is split, in half GiB.
    mem = None if memory_gib is None else max(0.5, int(memory_gib * 0.9 / learners * 2) / 2)
    per = gpu_count // learners if gpu_count >= SEAT_GPUS * learners else 0
    pairs = 0 if per else gpu_count // SEAT_GPUS
    odd = 0 if per else gpu_count % SEAT_GPUS
    out = []
    for i in range(learners):
        env = {"OMP_NUM_THREADS": str(threads)}
        if per:
            gpus = list(range(i * per, (i + 1) * per))
            note = f"{per} GPUs: NCCL, one GPU per rank"
        elif i < pairs:
            gpus = [SEAT_GPUS * i, SEAT_GPUS * i + 1]
            note = "2 GPUs: NCCL, one GPU per rank"
        elif i == pairs and odd:
            gpus = [gpu_count - 1]
            note = "1 GPU: single-device lessons on CUDA, ranks on gloo"
        else:
            gpus = []
            note = "CPU: gloo ranks" + (" (no GPU here)" if gpu_count == 0 else
                                        f" (the {gpu_count} GPU(s) went to learners before)")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        env["DPCOURSE_PROFILE"] = ("multi-gpu" if len(gpus) >= 2 else
                                   "one-gpu" if gpus else "cpu")
        cpus = _span(i * own_cores, own_cores) if own_cores else ""
        note += (f"; cores {cpus} (taskset -c {cpus})" if cpus else
                 f"; shares the {cpu_count} cores with {learners - 1} other learner(s)")
        if i == learners - 1:
            spare_gpus = gpu_count - (per * learners if per else pairs * SEAT_GPUS + odd)
            spare_cores = cpu_count - own_cores * learners if own_cores else 0
            if spare_gpus or spare_cores:
                note += (f" ({spare_gpus} GPU(s) and {spare_cores} core(s) left for the hub "
                         f"and the instructor)")
        out.append(LearnerSettings(i, env, note, cores, cpus, mem))
    return out


def summary(settings: list[LearnerSettings], gpu_count: int, cpu_count: int,
            memory_gib: float | None, ranks: int = MAX_RANKS) -> list[str]:
    """What each learner gets, in a few sentences grouped by kind of seat."""
    groups: dict[str, list[int]] = {}
    for s in settings:
        gpus = s.env["CUDA_VISIBLE_DEVICES"]
        kind = (f"{len(gpus.split(','))} GPU(s) each, profile {s.env['DPCOURSE_PROFILE']}"
                if gpus else "no GPU, profile cpu")
        groups.setdefault(kind, []).append(s.learner)
    first = settings[0]
    mem = (f"{memory_gib:g} GiB" if memory_gib else "memory unknown")
    lines = [f"{len(settings)} learners on {gpu_count} GPU(s), {cpu_count} core(s), {mem}:"]
    for kind, who in groups.items():
        span = f"learner {who[0]}" if len(who) == 1 else f"learners {who[0]}-{who[-1]}"
        lines.append(f"  {span}: {kind}")
    pinned = (f"{first.cores} core(s) of their own (pinned)" if first.cpus
              else f"the {cpu_count} core(s) shared by all")
    lines.append(f"  every learner: {pinned}, OMP_NUM_THREADS={first.env['OMP_NUM_THREADS']}"
                 + (f", {first.mem_gib:g} GiB of memory" if first.mem_gib else ""))
    if first.cores < ranks:
        lines.append(f"  lesson 06's fit starts {ranks} ranks: on {first.cores} core(s) they take "
                     "turns " + ("(slower for that learner only; the lesson's contention term "
                                 "models it)" if first.cpus else
                                 "with the other learners' ranks (everyone is slower then)"))
    return lines


def format_settings(settings: list[LearnerSettings]) -> str:
    """One line per learner, ready to paste into that learner's environment."""
    lines = []
    for s in settings:
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(s.env.items()))
        lines.append(f"learner {s.learner}: export {assignments}   # {s.note}")
    lines.append("MASTER_PORT stays unset: every launch picks a free port of its own.")
    return "\n".join(lines)


def format_jupyterhub(gpu_count: int, cpu_count: int, learners: int,
                      memory_gib: float | None, ranks: int = MAX_RANKS) -> str:
    """The plan as lines of a ``jupyterhub_config.py``: the seats as comments, then the call to
    :func:`configure_hub` that gives them out (the form ``classroom/jupyterhub_config.py``
    uses)."""
    settings = learner_settings(learners, gpu_count, cpu_count, ranks, memory_gib)
    lines = ["# dpcourse classroom, from: python -m dpcourse workshop-check --plan "
             f"--gpus {gpu_count} --cores {cpu_count} --learners {learners}"
             + (f" --memory {memory_gib:g}" if memory_gib else "") + " --format jupyterhub"]
    lines += ["# " + line for line in summary(settings, gpu_count, cpu_count, memory_gib, ranks)]
    lines.append("# seats (given to learners in order of their first login, kept in seats.json):")
    for s in settings:
        env = " ".join(f"{k}={v or '(empty)'}" for k, v in sorted(s.env.items()))
        lines.append(f"#   seat {s.learner}: {env}; {s.note}")
    lines += [
        "from dpcourse.tools import workshop",
        "",
        f"workshop.configure_hub(c, learners={learners}, gpus={gpu_count}, cores={cpu_count}, "
        f"memory_gib={memory_gib!r}, ranks={ranks})",
    ]
    return "\n".join(lines) + "\n"


def machine(gpus=None, cores=None, memory_gib=None):
    """This machine's GPUs, cores and memory (GiB) where not given."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cores is None:
        from dpcourse import devices

        cores = devices.usable_cores()
    if memory_gib is None:  # 0: unknown, leave it so
        import psutil

        memory_gib = round(psutil.virtual_memory().total / 2**30, 1)
    return gpus, cores or 1, memory_gib


def parse_cpus(cpus: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5}."""
    out: set[int] = set()
    for part in filter(None, cpus.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m dpcourse workshop-check`` (and of one pretend learner)."""
    import argparse

    from dpcourse.tools.workshop_rehearsal import (STEPS, format_report, run_learner,
                                                   workshop_check)

    p = argparse.ArgumentParser(prog="python -m dpcourse workshop-check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--plan", action="store_true", help="print the seats, run nothing")
    p.add_argument("--gpus", type=int, default=None, help="the server's GPUs (default: here)")
    p.add_argument("--cores", type=int, default=None, help="the server's cores (default: here)")
    p.add_argument("--memory", type=float, default=None, metavar="GIB",
                   help="the server's memory in GiB (default: here)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="with --plan: exports (default), jupyterhub or json")
    p.add_argument("--max-ranks", type=int, default=MAX_RANKS,
                   help=f"the most ranks one learner starts at once (default {MAX_RANKS}: "
                   "lesson 06's fit)")
    p.add_argument("--threads", type=int, default=None,
                   help="rehearse with this OMP_NUM_THREADS instead of the plan's")
    p.add_argument("--ranks", type=int, default=None, help=argparse.SUPPRESS)  # older spelling
    p.add_argument("--only", action="append", choices=STEPS, metavar="STEP",
                   help=f"rehearse only these steps (repeatable; of {', '.join(STEPS)})")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per launch")
    p.add_argument("--json", action="store_true", help="the same as --format json")
    p.add_argument("--as-learner", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ranks = args.ranks if args.ranks is not None else args.max_ranks
    for name, value in (("learners", args.learners), ("ranks" if args.ranks is not None
                                                      else "max-ranks", ranks),
                        ("cores", args.cores), ("threads", args.threads)):
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1, got {value}")
    if args.gpus is not None and args.gpus < 0:
        p.error(f"--gpus must be 0 or more, got {args.gpus}")
    if args.memory is not None and args.memory <= 0:
        p.error(f"--memory must be a positive number of GiB, got {args.memory:g}")
    if args.timeout <= 0:
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    fmt = args.format or ("json" if args.json else "exports")
    if args.as_learner is not None:
        print(json.dumps(run_learner(args.as_learner, args.timeout, ranks,
                                     args.only or STEPS)))
        return 0
    if args.plan:
        elsewhere = args.gpus is not None or args.cores is not None
        # a plan for another server does not take this machine's memory for that server's
        gpus, cores, mem = machine(args.gpus, args.cores,
                                    args.memory if args.memory or not elsewhere else 0)
        mem = mem or None
        settings = learner_settings(args.learners, gpus, cores, ranks, mem)
        if fmt == "json":
            print(json.dumps({"gpus": gpus, "cores": cores, "memory_gib": mem,
                              "learners": args.learners, "max_ranks": ranks,
                              "seats": [asdict(s) for s in settings]}, indent=1))
        elif fmt == "jupyterhub":
            print(format_jupyterhub(gpus, cores, args.learners, mem, ranks), end="")
        else:
            print("\n".join(summary(settings, gpus, cores, mem, ranks)))
            print(format_settings(settings))
        return 0
    if args.format not in (None, "json") or args.memory is not None:
        p.error("--format exports/jupyterhub and --memory go with --plan")
    report = workshop_check(args.learners, args.timeout, args.gpus, args.cores, args.threads,
                            ranks, args.only or STEPS)
    if fmt == "json":
        print(json.dumps(asdict(report) | {"ok": report.ok}, indent=1))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


# The hub's side and the rehearsal, each a module of its own, answer for their names here too:
# ``from dpcourse.tools.workshop import SeatBook`` and ``workshop.workshop_check(...)`` still
# work. Looked up on first use (PEP 562), because both modules build on the plan above.
_ELSEWHERE = {
    "workshop_hub": ("COURSE_PARTS", "DEFAULT_URL", "SeatBook", "copy_course", "learner_home",
                     "learner_names", "pre_spawn_hook", "configure_hub", "EDITIONS",
                     "EditionBook", "class_edition", "edition_url"),
    "workshop_rehearsal": ("TAG", "TRAIN_DDP", "STEPS", "measured", "run_learner",
                           "WorkshopReport", "oversubscription", "tagged_processes",
                           "port_is_bound", "workshop_check", "duplicate_ports",
                           "format_report"),
}


def __getattr__(name: str):
    for module, names in _ELSEWHERE.items():
        if name in names:
            return getattr(importlib.import_module(f"dpcourse.tools.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {n for names in _ELSEWHERE.values() for n in names})


if __name__ == "__main__":
    sys.exit(main())
