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
