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
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
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
LIB = Path(__file__).resolve().parents[1]
ROOT = LIB.parents[1]  # the repository (a course checkout)
TRAIN_DDP = LIB / "scripts" / "train_ddp.py"
MAX_RANKS = 4  # the most ranks one learner starts at once: lesson 06's alpha-beta fit
SEAT_GPUS = 2  # a GPU seat below two GPUs per learner: lesson 03's two NCCL ranks
FORMATS = ("exports", "jupyterhub", "json")
# What a learner's copy of the course holds (the library is imported from the course's
# environment, not copied).
COURSE_PARTS = ("lessons", "labs", "solutions", "README.md", "jupytext.toml")
DEFAULT_URL = "/lab/tree/lessons/00_start_here.ipynb"


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


# --------------------------------------------------------------------------------------------
# The hub's side: seats kept across restarts, a copy of the course per learner
# --------------------------------------------------------------------------------------------


class SeatBook:
    """Which learner holds which seat, in a JSON file: a learner keeps their seat (and so their
    GPUs and cores) across hub restarts and server restarts. A new learner takes the lowest
    free seat; an instructor may edit the file while the hub is stopped."""

    def __init__(self, path: str | os.PathLike, seats: list[LearnerSettings]):
        self.path, self.seats = Path(path), seats

    def assignments(self) -> dict[str, int]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        if not isinstance(data, dict):
            raise ValueError(f"{self.path} should hold {{learner: seat}}, got {type(data).__name__}")
        return {str(k): int(v) for k, v in data.items()}

    def seat_for(self, user: str) -> LearnerSettings:
        taken = self.assignments()
        if user not in taken:
            free = sorted(set(range(len(self.seats))) - set(taken.values()))
            if not free:
                raise RuntimeError(f"all {len(self.seats)} seats are taken ({self.path}); start "
                                   f"the hub with more learners (DPCOURSE_LEARNERS) to seat "
                                   f"{user}")
            taken[user] = free[0]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(taken, indent=1, sort_keys=True))
            os.replace(tmp, self.path)  # a reader never sees half a file
        seat = taken[user]
        if not 0 <= seat < len(self.seats):
            raise RuntimeError(f"{user} holds seat {seat} in {self.path}, but the plan has "
                               f"{len(self.seats)} seats")
        return self.seats[seat]


def copy_course(dest: str | os.PathLike, source: str | os.PathLike = ROOT,
                owner: str | None = None) -> int:
    """Copy the course (:data:`COURSE_PARTS`) from ``source`` into ``dest``, file by file, only
    where ``dest`` has no such file: a learner's work is never overwritten, and a file they
    deleted comes back fresh at their next start (how to reset a lab). With ``owner`` (when the
    hub runs as root), what is created belongs to that user. Returns the files copied."""
    source, dest = Path(source), Path(dest)
    ids = None
    if owner is not None and os.geteuid() == 0:
        entry = pwd.getpwnam(owner)
        ids = (entry.pw_uid, entry.pw_gid)
    skip = {".ipynb_checkpoints", "__pycache__"}
    copied = 0

    def make_dir(path: Path) -> None:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        if ids:
            for p in missing:
                os.chown(p, *ids)

    for part in COURSE_PARTS:
        src = source / part
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file()
                                                   and not skip & set(p.parts))
        for f in files:
            target = dest / f.relative_to(source)
            if target.exists():
                continue
            make_dir(target.parent)
            shutil.copy2(f, target)
            if ids:
                os.chown(target, *ids)
            copied += 1
    return copied


def learner_home(spawner) -> Path:
    """The learner's home: SimpleLocalProcessSpawner's ``home_dir`` (rehearsal), else the Unix
    user's home (LocalProcessSpawner, SystemdSpawner)."""
    home = getattr(spawner, "home_dir", None)
    if home:
        return Path(home)
    return Path(pwd.getpwnam(spawner.user.name).pw_dir)


def learner_names(learners: int) -> list[str]:
    """The rehearsal accounts: learner01, learner02, ..."""
    _positive("learners", learners)
    width = max(2, len(str(learners)))
    return [f"learner{i + 1:0{width}d}" for i in range(learners)]


def pre_spawn_hook(seats: list[LearnerSettings], seats_file: str | os.PathLike,
                   course: str | os.PathLike = ROOT, progress: str | os.PathLike | None = None,
                   pin: bool = True):
    """A JupyterHub ``Spawner.pre_spawn_hook``: before a learner's server starts, give it the
    learner's seat (environment, CPU and memory limits, pinned cores), their own copy of the
    course as the folder it serves, and the class's progress file."""
    book = SeatBook(seats_file, seats)
    taskset = shutil.which("taskset")

    def hook(spawner) -> None:
        name = spawner.user.name
        seat = book.seat_for(name)
        spawner.environment = dict(spawner.environment or {}, **seat.env,
                                   DPCOURSE_SEAT=str(seat.learner))
        if progress is not None:
            path = Path(progress)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
            if os.geteuid() == 0:
                path.chmod(0o666)  # every learner's kernel appends to it (checks.recorded)
            spawner.environment["DPCOURSE_PROGRESS"] = str(path)
        owner = None if getattr(spawner, "home_dir", None) else name
        folder = learner_home(spawner) / "dpcourse"
        copied = copy_course(folder, course, owner)
        spawner.notebook_dir = str(folder)
        spawner.cpu_limit = float(seat.cores)  # enforced by SystemdSpawner and DockerSpawner
        if seat.mem_gib:
            spawner.mem_limit = f"{int(seat.mem_gib * 1024)}M"
        cmd = list(spawner.cmd)
        if pin and seat.cpus and taskset and cmd[:1] != [taskset]:
            spawner.cmd = [taskset, "-c", seat.cpus, *cmd]
        spawner.log.info("dpcourse: %s has seat %d (%s), %d course file(s) copied into %s",
                         name, seat.learner, seat.note, copied, folder)

    return hook


def configure_hub(c, learners: int, gpus: int | None = None, cores: int | None = None,
                  memory_gib: float | None = None, ranks: int = MAX_RANKS,
                  state: str | os.PathLike | None = None, course: str | os.PathLike = ROOT,
                  pin: bool = True) -> list[LearnerSettings]:
    """Set a JupyterHub config ``c`` up for a classroom of ``learners``: each learner's server
    gets their seat (:func:`pre_spawn_hook`), runs in this Python environment (the course's: the
    kernel learners get is this interpreter), serves their own copy of the course and opens
    lesson 00. ``state`` holds ``seats.json`` and ``progress.jsonl`` (the class's lab checks).
    GPUs, cores and memory default to this machine's. Returns the seats."""
    gpus, cores, mem = machine(gpus, cores, memory_gib)
    seats = learner_settings(learners, gpus, cores, ranks, mem)
    state = Path(state) if state is not None else Path.cwd()
    c.Spawner.pre_spawn_hook = pre_spawn_hook(seats, state / "seats.json", course,
                                              state / "progress.jsonl", pin)
    c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
    c.Spawner.default_url = DEFAULT_URL
    # learners do not install JupyterLab extensions, and a classroom may have no internet
    c.Spawner.args = ["--LabApp.extension_manager=readonly"]
    c.Spawner.cpu_limit = float(seats[0].cores)
    if seats[0].mem_gib:
        c.Spawner.mem_limit = f"{int(seats[0].mem_gib * 1024)}M"
    # a crowded server starts twenty servers at once: give each more than the default 60 s
    c.Spawner.start_timeout = 180
    c.Spawner.http_timeout = 120
    return seats


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

    for p in model.parameters():
        if p.grad is not None:
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m dpcourse workshop-check`` (and of one pretend learner)."""
    import argparse

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


if __name__ == "__main__":
    sys.exit(main())
