"""Shared fixtures: every test that launches processes must leave none behind."""

import collections
import contextlib
import importlib.util
import os
from pathlib import Path

import psutil
import pytest

# One OpenMP thread per process, for this process and everything it starts (nbval's kernels,
# the ranks, torchrun: they inherit the environment), unless the caller set it. The suite runs
# as two xdist workers on two cores, each with ranks of its own: torch's default of a thread per
# core then puts several spinning threads on each core, and a parallel region waits for a thread
# that is not running. Measured here at load 7-12 (2026-11-28): `train.fit` on 2,000 samples,
# 35-65 s with torch's 2 threads against 7-16 s with 1; lesson 01 under nbval hit the 300 s cell
# limit with 2, and passed in 122 s with 1 (36 s of CPU against 207 s). What the suite proves does
# not depend on it: the stored outputs are the same (lessons set 1 thread themselves where they
# time anything), and a learner's notebook keeps torch's default.
os.environ.setdefault("OMP_NUM_THREADS", "1")

if importlib.util.find_spec("triton"):
    # Some tests load TensorFlow into this process; torch's triton segfaults if it is loaded
    # after TF (measured), so load it first.
    import triton  # noqa: F401


def stray_processes():
    """Descendants of this test process, except multiprocessing's own long-lived helpers (the
    fork server and the resource tracker) and Jupyter kernels that nbval owns."""
    strays = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if "multiprocessing" in cmd or "ipykernel" in cmd:
            continue
        strays.append((child.pid, cmd))
    return strays


def listening_ports():
    return {c.laddr.port for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


@pytest.fixture
def no_leftovers():
    """Fails the test if it left a process running."""
    yield
    import time

    deadline = time.monotonic() + 5
    while stray_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stray_processes() == [], "processes left running"



@contextlib.contextmanager
def launches_replayed(key_of, also_replay=(), files_in=None):
    """``launch.spawn`` launching each distinct run for real once, replaying it after: for test
    files that repeat a run (a mistake met twice, the same answer checked again). Everything
    after the launch (the check's judgement, its memory of mistakes, its sentence) runs again.

    ``key_of(worker, world_size, args, kwargs, timeout)`` names the run, or is None for one to
    launch every time. A repeat gets a copy of what the ranks returned, or the same
    RankFailedError (and the exceptions in ``also_replay``); any other exception (a timeout,
    unless listed) is never recorded. ``files_in(args)``: a folder the run leaves files in,
    saved after the real run and written back on each replay."""
    import copy

    from dpcourse import launch

    real_spawn, runs = launch.spawn, {}

    def spawn(worker, world_size, *args, timeout, **kwargs):
        key = key_of(worker, world_size, args, kwargs, timeout)
        if key is None:
            return real_spawn(worker, world_size, *args, timeout=timeout, **kwargs)
        folder = Path(files_in(args)) if files_in else None
        if key not in runs:
            try:
                outcome = ("returned", real_spawn(worker, world_size, *args, timeout=timeout,
                                                  **kwargs))
            except (launch.RankFailedError, *also_replay) as exc:
                outcome = ("raised", exc)
            runs[key] = (outcome, {name: (folder / name).read_text()
                                   for name in os.listdir(folder)} if folder else {})
        (how, value), files = runs[key]
        for name, text in files.items():
            (folder / name).write_text(text)
        if how == "raised":
            raise value
        return copy.deepcopy(value)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "spawn", spawn)
        yield


def distinct_run(worker, world_size, args, kwargs, timeout):
    """A run's key for :func:`launches_replayed`: the worker, world size and arguments (the
    learner's function or class itself, the backend), or None when they cannot be hashed (an
    answer built inside a test: new objects each time, so it always launches)."""
    key = (worker, world_size, args, tuple(sorted((k, v) for k, v in kwargs.items()
                                                  if k != "show_output")))
    try:
        hash(key)
    except TypeError:
        return None
    return key


RAISED = "this run raised on a rank: it launches alone"


def in_one_launch(rank, world_size, worker, runs):
    """Every run of ``runs`` (a list of argument tuples) in turn; after each, the ranks check
    that they are still in step (the same run, no collective left over) before the next."""
    import torch
    import torch.distributed as dist

    results = []
    for i, args in enumerate(runs):
        try:
            results.append(worker(rank, world_size, *args))
        except Exception:                           # noqa: BLE001 - that run launches alone
            results.append(RAISED)
        step = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(step, torch.tensor([float(i)]))
        if any(int(t) != i for t in step):
            return results[:-1]                     # out of step: the rest launch alone
    return results


@contextlib.contextmanager
def answers_in_one_launch(table, timeout=240):
    """Several answers judged in one launch, for lab-check test files whose answers are
    stateless (each worker builds its seeded model and data): the check's own worker runs every
    answer of a group in ``table`` (``{(worker, world_size): [args, ...]}``) in turn on one gloo
    process group, and each answer's results are what the check receives when it asks for that
    run. The check a learner runs still launches once per answer; everything after the launch
    (the check's judgement, its memory of mistakes, its sentence) runs per test as before. A run
    that raised on a rank, one not in ``table``, or a group whose launch failed or whose ranks
    fell out of step, launches for real. One lock per group: a check running in a thread beside
    another test never waits for the other group's launch."""
    import copy
    import threading

    from dpcourse import launch

    one_at_a_time, launched = launch.spawn, {}
    locks = {group: threading.Lock() for group in table}

    def results_of(worker, world_size):
        group = (worker, world_size)
        with locks[group]:
            if group not in launched:
                runs = table[group]
                try:
                    per_rank = one_at_a_time(in_one_launch, world_size, worker, runs,
                                             backend="gloo", timeout=timeout, show_output=False)
                except launch.LaunchError:
                    per_rank = [[] for _ in range(world_size)]
                launched[group] = {
                    args: [r[i] for r in per_rank] for i, args in enumerate(runs)
                    if all(i < len(r) and not (isinstance(r[i], str) and r[i] == RAISED)
                           for r in per_rank)}
            return launched[group]

    def spawn(worker, world_size, *args, timeout, **kwargs):
        if (worker, world_size) in table and kwargs.get("backend") == "gloo":
            try:
                outs = results_of(worker, world_size).get(args)
            except TypeError:                       # arguments that cannot be a key
                outs = None
            if outs is not None:
                return copy.deepcopy(outs)
        return one_at_a_time(worker, world_size, *args, timeout=timeout, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "spawn", spawn)
        yield


def pytest_ignore_collect(collection_path, config):
    """tests/browser (JupyterLab in headless Chromium, about a minute) runs as its own command,
    README's "Browser tests", which .ci/run also runs: the main suite keeps its 10 minutes.
    Naming the folder (python -m pytest tests/browser) runs it."""
    browser = config.rootpath / "tests" / "browser"
    if collection_path == browser:
        named = any(str(arg).split("::")[0].rstrip("/").endswith("tests/browser")
                    or "tests/browser/" in str(arg) for arg in config.args)
        return None if named else True
    return None


# Longest files first. `-n 2 --dist loadfile` hands whole files to the two workers in the
# order of the work queue; xdist's default queue is sorted by *number of tests*, which puts
# files with few but slow tests (the workshop's, the doctor's, the install's) last, where one
# of them can leave a worker running alone for a minute at the end. Ordered by seconds
# instead (the largest first: the classic longest-processing-time rule), the two workers end
# closer together. tests/file_seconds.txt is the table CI's log prints ("slowest files"),
# copied in; a file missing from it is weighted as a typical (median) one, and
# test_repo.py asks for the table to name every file.
FILE_SECONDS = Path(__file__).with_name("file_seconds.txt")


def file_seconds() -> dict:
    """tests/file_seconds.txt as {path: seconds}."""
    table = {}
    for line in FILE_SECONDS.read_text().splitlines():
        if line.strip():
            seconds, path = line.split()
            table[path] = float(seconds)
    return table


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):   # pytest-xdist is active
        config.option.loadscopereorder = False        # keep our order (set below) as the queue


def pytest_collection_modifyitems(config, items):
    table = file_seconds()
    typical = sorted(table.values())[len(table) // 2] if table else 0.0
    # A stable sort on the file's weight alone keeps each file's tests (and each notebook's
    # cells) together and in their own order.
    items.sort(key=lambda item: -table.get(item.nodeid.split("::")[0], typical))


@pytest.fixture(autouse=True)
def _fresh_mistake_memory():
    """A check shows a mistake's fix only when the learner meets it again in the same kernel
    (dpcourse.checks.fail's fix=), holds them to their first prediction and names a second wrong
    answer as a search: each test starts as a learner's first attempt."""
    from dpcourse import checks

    checks.forget()
    yield


# The suite's time, file by file (setup + call + teardown of every test or notebook cell in it,
# summed): printed at the end of every run, so a slow file shows in CI's log without a rerun.
# Under xdist the controller receives every worker's reports, so the sums cover the whole run.
_SECONDS_PER_FILE: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    _SECONDS_PER_FILE[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_SECONDS_PER_FILE) < 2:
        return
    terminalreporter.section("slowest files (seconds of their tests, summed)")
    # Every file, not only the slowest: the note's before/after per file comes from CI's log.
    for path, seconds in _SECONDS_PER_FILE.most_common():
        terminalreporter.write_line(f"{seconds:7.1f}  {path}")
    terminalreporter.write_line(f"{sum(_SECONDS_PER_FILE.values()):7.1f}  all "
                                f"{len(_SECONDS_PER_FILE)} files")
