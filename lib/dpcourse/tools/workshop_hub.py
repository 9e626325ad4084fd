"""The classroom hub's side of the workshop plan: each learner keeps a seat across restarts
(:class:`SeatBook`), gets a copy of the course of their own (:func:`copy_course`), and their
Jupyter server starts with the seat's environment and limits (:func:`pre_spawn_hook`, set up by
:func:`configure_hub`, which ``classroom/jupyterhub_config.py`` calls). Each learner also has an
edition, English or Chinese (:data:`EDITIONS`): the class's from ``DPCOURSE_EDITION``
(:func:`class_edition`), or their own from ``editions.json`` (:class:`EditionBook`).

The seats themselves come from the plan, :func:`dpcourse.tools.workshop.learner_settings`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
from pathlib import Path

from dpcourse.tools.workshop import (MAX_RANKS, ROOT, LearnerSettings, _positive,
                                     learner_settings, machine)

# What a learner's copy of the course holds (the library is imported from the course's
# environment, not copied); zh/ is the Chinese edition, copied for every learner.
COURSE_PARTS = ("lessons", "labs", "solutions", "zh", "README.md", "jupytext.toml")
# The page each edition opens: its lesson 00 (zh/ keeps the English folders' names).
EDITIONS = {"en": "lessons/00_start_here.ipynb", "zh": "zh/lessons/00_start_here.ipynb"}
DEFAULT_URL = "/lab/tree/" + EDITIONS["en"]


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


def _one_of(where: str, value) -> str:
    if not isinstance(value, str) or value not in EDITIONS:
        raise ValueError(f"{where} is {value!r}: use {' or '.join(EDITIONS)}")
    return value


def class_edition(environ=None) -> str:
    """The class's edition: ``DPCOURSE_EDITION`` (``en`` or ``zh``), ``en`` where unset."""
    environ = os.environ if environ is None else environ
    return _one_of("DPCOURSE_EDITION", environ.get("DPCOURSE_EDITION") or "en")


def edition_url(edition: str) -> str:
    """The page a learner's server opens for ``edition``: that edition's lesson 00."""
    return "/lab/tree/" + EDITIONS[_one_of("the edition", edition)]


class EditionBook:
    """Each learner's edition: their own from a JSON file ``{learner: "zh"}`` that an instructor
    writes (read at every server start, so an edit applies at the learner's next start), else
    the class's ``default``."""

    def __init__(self, path: str | os.PathLike, default: str = "en"):
        self.path, self.default = Path(path), _one_of("the class's edition", default)

    def editions(self) -> dict[str, str]:
        """The file's ``{learner: edition}``; ``{}`` without a file. A file that is not such a
        mapping, or names an edition other than en or zh, raises one line naming the file."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.path} is not JSON ({err}): it should hold "
                             f'{{learner: "en" or "zh"}}') from None
        if not isinstance(data, dict):
            raise ValueError(f'{self.path} should hold {{learner: "en" or "zh"}}, got '
                             f"{type(data).__name__}")
        return {str(k): _one_of(f"{self.path}: {k}'s edition", v) for k, v in data.items()}

    def edition_for(self, user: str) -> str:
        return self.editions().get(user, self.default)


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
                   pin: bool = True, editions: EditionBook | None = None):
    """A JupyterHub ``Spawner.pre_spawn_hook``: before a learner's server starts, give it the
    learner's seat (environment, CPU and memory limits, pinned cores), their own copy of the
    course as the folder it serves, the class's progress file, and their edition
    (``DPCOURSE_EDITION``, and its lesson 00 as the page that opens; English without
    ``editions``)."""
    book = SeatBook(seats_file, seats)
    taskset = shutil.which("taskset")

    def hook(spawner) -> None:
        name = spawner.user.name
        seat = book.seat_for(name)
        edition = editions.edition_for(name) if editions is not None else "en"
        spawner.environment = dict(spawner.environment or {}, **seat.env,
                                   DPCOURSE_SEAT=str(seat.learner), DPCOURSE_EDITION=edition)
        spawner.default_url = edition_url(edition)
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
        spawner.log.info("dpcourse: %s has seat %d (%s), edition %s, %d course file(s) copied "
                         "into %s", name, seat.learner, seat.note, edition, copied, folder)

    return hook


def configure_hub(c, learners: int, gpus: int | None = None, cores: int | None = None,
                  memory_gib: float | None = None, ranks: int = MAX_RANKS,
                  state: str | os.PathLike | None = None, course: str | os.PathLike = ROOT,
                  pin: bool = True, edition: str | None = None) -> list[LearnerSettings]:
    """Set a JupyterHub config ``c`` up for a classroom of ``learners``: each learner's server
    gets their seat (:func:`pre_spawn_hook`), runs in this Python environment (the course's: the
    kernel learners get is this interpreter), serves their own copy of the course and opens
    lesson 00 of their edition. ``state`` holds ``seats.json``, ``progress.jsonl`` (the class's
    lab checks) and ``editions.json`` (learners whose edition is not the class's ``edition``,
    which defaults to ``DPCOURSE_EDITION``, else English; a bad one stops the hub here).
    GPUs, cores and memory default to this machine's. Returns the seats."""
    gpus, cores, mem = machine(gpus, cores, memory_gib)
    seats = learner_settings(learners, gpus, cores, ranks, mem)
    state = Path(state) if state is not None else Path.cwd()
    edition = class_edition() if edition is None else _one_of("edition", edition)
    editions = EditionBook(state / "editions.json", edition)
    editions.editions()  # a bad file stops the hub at its start, not a learner's first login
    c.Spawner.pre_spawn_hook = pre_spawn_hook(seats, state / "seats.json", course,
                                              state / "progress.jsonl", pin, editions)
    c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
    c.Spawner.default_url = edition_url(edition)
    # learners do not install JupyterLab extensions, and a classroom may have no internet
    c.Spawner.args = ["--LabApp.extension_manager=readonly"]
    c.Spawner.cpu_limit = float(seats[0].cores)
    if seats[0].mem_gib:
        c.Spawner.mem_limit = f"{int(seats[0].mem_gib * 1024)}M"
    # a crowded server starts twenty servers at once: give each more than the default 60 s
    c.Spawner.start_timeout = 180
    c.Spawner.http_timeout = 120
    return seats
