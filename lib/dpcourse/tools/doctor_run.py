"""``python -m dpcourse doctor --run``: prove the whole course on this machine, notebook by notebook.

``doctor`` says what the machine has; ``doctor --run`` shows that every lesson and every lab
solution actually runs on it, under the same strict ``nbval`` comparison as CI, on the
machine's own profile (``cpu``, ``one-gpu`` or ``multi-gpu``: see :mod:`dpcourse.devices`).
The stored outputs were produced on the CPU; every output that depends on the device (timings,
the profile line, throughput) is marked ``NBVAL_IGNORE_OUTPUT`` with its reason, and every ✔
claim must hold on every profile — so a red row here is a real difference worth reporting.

It first runs ``tests/test_gpu.py``, the checks that only mean something on a GPU (NCCL
chosen and one GPU per rank, fp16 autocast with ``GradScaler``, real ``nn.DataParallel`` on two
GPUs, TensorFlow's logical GPUs next to torch in one process). Without a GPU they are skipped,
and the row says so.

    python -m dpcourse doctor --run                       # everything, one notebook at a time
    python -m dpcourse doctor --run --only 03 --only lab07
    python -m dpcourse doctor --run --profile cpu         # rehearse the CPU path on a GPU box
    python -m dpcourse doctor --run --list                # what would run
    python -m dpcourse doctor --run --json > results.json

Each notebook runs in a ``pytest --nbval`` process of its own (a fresh kernel, like CI), bounded
by ``--timeout`` seconds and killed with everything it started if it goes over. Run it from a
clone of the course: it needs ``lessons/``, ``solutions/`` and ``tests/``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

GPU_TESTS = "tests/test_gpu.py"
_ANSI = re.compile(r"\x1b\[[0-9;]*m|#x1B\[[0-9;]*m")
_EXCEPTION = re.compile(r"^(E\s+)?[A-Za-z_.]*(Error|Exception|Interrupt)\b.*")


@dataclass
class Result:
    """One row of the report: a notebook (or the GPU tests) and how it went."""

    path: str
    passed: bool
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)  # passed / failed / skipped cells
    failures: list[str] = field(default_factory=list)     # "Cell 12: what went wrong"
    # per failure, what nbval said after its "Traceback:" (the diff of a cell whose outputs
    # differ, "Unexpected output fields ... {'stderr'}", an exception's last lines): a row that
    # says only "outputs differ" cannot be acted on from another machine's report
    details: list[str] = field(default_factory=list)


def course_root(start: Path | None = None) -> Path:
    """The clone this library sits in (lib/dpcourse/tools -> the root), or a clear error."""
    root = (start or Path(__file__).resolve().parents[3])
    if not all((root / d).is_dir() for d in ("lessons", "solutions", "tests")):
        raise FileNotFoundError(
            f"doctor --run needs a clone of the course (lessons/, solutions/, tests/); {root} "
            f"is not one. Run it from the clone, with its lib/ on PYTHONPATH or installed with "
            f"pip install -e .")
    return root


def targets(root: Path, only: list[str] | None = None, gpu_tests: bool = True) -> list[Path]:
    """The GPU tests, then every lesson, then every lab solution, in course order.
    ``only``: keep the notebooks whose file name contains one of these strings."""
    notebooks = sorted((root / "lessons").glob("*.ipynb")) + sorted(
        (root / "solutions").glob("*.ipynb"))
    if only:
        notebooks = [nb for nb in notebooks if any(o in nb.name for o in only)]
        if not notebooks:
            raise ValueError(f"no lesson or solution notebook matches {', '.join(only)}")
    gpu = [root / GPU_TESTS] if gpu_tests and not only and (root / GPU_TESTS).exists() else []
    return gpu + notebooks


def _first_line(text: str) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line and not set(line) <= set("-=_+ "):
            return line[:200]
    return "(no message)"


def _detail(lines: list[str], limit: int = 20) -> str:
    """What nbval printed after "Traceback:" (its diff or the exception), blank lines dropped;
    without that marker, the text's last lines."""
    marks = [i for i, ln in enumerate(lines) if ln == "Traceback:"]
    kept = lines[marks[-1] + 1:] if marks else lines
    kept = [ln for ln in kept if ln and not set(ln) <= set("-=_+^? ")]
    return "\n".join(kept[:limit] if marks else kept[-limit:])


def parse_junit(xml_text: str) -> tuple[dict[str, int], list[str], list[str]]:
    """Counts, one line per failing cell (or test), and each failure's detail (see
    :func:`_detail`) from pytest's JUnit XML."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures, details = [], []
    for case in ET.fromstring(xml_text).iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed"] += 1
            # nbval's message is a header; the useful part is in the element's text: the
            # exception a cell raised, or nbval's own "Cell N: Cell outputs differ".
            lines = [_ANSI.sub("", ln).strip() for ln in (bad.text or "").splitlines()]
            exc = [ln for ln in lines if _EXCEPTION.match(ln)]
            said = [ln for ln in lines if ln.startswith("Cell ") and ": " in ln]
            name = case.get("name", "").lstrip(":")
            if exc:
                why = exc[-1]
            elif said:
                why = said[0].split(": ", 1)[1]
            else:
                why = _first_line(_ANSI.sub("", bad.get("message") or ""))
            failures.append(f"{name}: {why}"[:240])
            details.append(_detail(lines))
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failures, details


def run_one(root: Path, target: Path, timeout: float = 900.0, env: dict | None = None) -> Result:
    """``pytest --nbval`` (or plain pytest for the GPU tests) on one file, in its own process."""
    from dpcourse import launch

    rel = os.path.relpath(target, root)
    with tempfile.TemporaryDirectory(prefix="dpcourse-doctor-") as tmp:
        junit = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", str(target), "-c", str(root / "pyproject.toml"),
               "--rootdir", str(root), "-p", "no:xdist", "-q", f"--junitxml={junit}",
               "-o", "junit_family=xunit2"]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            launch.kill_tree(proc.pid)
            proc.communicate()
            return Result(rel, False, round(time.monotonic() - start, 1), {},
                          [f"did not finish within {timeout:g} s (stopped, with its kernel)"])
        except BaseException:
            launch.kill_tree(proc.pid)
            proc.communicate()
            raise
        seconds = round(time.monotonic() - start, 1)
        if not os.path.exists(junit):  # pytest itself failed to start
            return Result(rel, False, seconds, {}, [_first_line(out[-2000:])])
        counts, failures, details = parse_junit(Path(junit).read_text())
    passed = proc.returncode == 0 and counts["failed"] == 0
    if proc.returncode not in (0, 1) and not failures:
        failures = [f"pytest exited with code {proc.returncode}: {_first_line(out[-2000:])}"]
        details = [out[-2000:]]
    return Result(rel, passed, seconds, counts, failures, details)


def describe_profile(profile: str | None = None) -> str:
    """The profile the notebooks will pick (``profile`` forces one, as DPCOURSE_PROFILE does)."""
    from dpcourse import devices

    saved = os.environ.get("DPCOURSE_PROFILE")
    try:
        if profile is not None:
            os.environ["DPCOURSE_PROFILE"] = profile
        return devices.choose_profile().describe()
    finally:
        if saved is None:
            os.environ.pop("DPCOURSE_PROFILE", None)
        else:
            os.environ["DPCOURSE_PROFILE"] = saved


def versions_first_cell() -> list[str]:
    """What ``check_versions()``, every notebook's first cell, will print in a fresh kernel here
    (nothing loaded yet, so only the installed versions count)."""
    from dpcourse import versions

    return versions.version_problems(loaded={}, notebook=True)


def run_course(only: list[str] | None = None, profile: str | None = None,
               timeout: float = 900.0, root: Path | None = None, echo=print) -> list[Result]:
    """Run every target in turn; ``echo`` gets each row as it finishes (a long run shows
    progress)."""
    root = course_root(root)
    env = dict(os.environ)
    if profile is not None:
        env["DPCOURSE_PROFILE"] = profile
    lib = str(root / "lib")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [lib, env.get("PYTHONPATH")]))
    rows = []
    for target in targets(root, only):
        row = run_one(root, target, timeout, env)
        rows.append(row)
        if echo:
            echo(format_row(row))
    return rows


def format_row(r: Result, detail_lines: int = 6) -> str:
    """The row, its first five failures, and up to ``detail_lines`` lines of each one's detail
    (``--json`` keeps all of it)."""
    tally = ", ".join(f"{n} {kind}" for kind, n in r.counts.items() if n or kind != "skipped")
    out = [f"{'PASS' if r.passed else 'FAIL'}  {r.path:<45} {r.seconds:>7.1f} s  {tally}"]
    for i, failure in enumerate(r.failures[:5]):
        out.append(f"      {failure}")
        said = r.details[i].splitlines() if i < len(r.details) else []
        out += [f"          {ln[:150]}" for ln in said[:detail_lines]]
    if len(r.failures) > 5:
        out.append(f"      ... and {len(r.failures) - 5} more")
    return "\n".join(out)


def summary(rows: list[Result]) -> str:
    bad = [r.path for r in rows if not r.passed]
    total = sum(r.seconds for r in rows)
    return (f"{len(rows) - len(bad)} of {len(rows)} passed in {total:.0f} s"
            + (f"; failed: {', '.join(bad)}" if bad else ""))


def main(only: list[str] | None = None, profile: str | None = None, timeout: float = 900.0,
         as_json: bool = False, list_only: bool = False) -> int:
    try:
        root = course_root()
        targets(root, only)  # an --only that matches nothing fails here, before any output
        if list_only:
            for t in targets(root, only):
                print(os.path.relpath(t, root))
            return 0
        described = describe_profile(profile)
        # every notebook's first cell prints these, so each one's Cell 0 fails where there are
        # any: say it once, up front, instead of leaving 24 identical rows to explain it
        problems = versions_first_cell()
        if not as_json:
            print("dpcourse doctor --run: every lesson and lab solution under strict nbval")
            print(described)
            for line in problems:
                print(f"  version: {line}")
            if problems:
                print("  (every notebook's first cell prints the lines above, so each one's "
                      "Cell 0 fails here: its stored output is empty)")
        rows = run_course(only, profile, timeout, root, echo=None if as_json else print)
    except (FileNotFoundError, ValueError) as exc:
        print(f"doctor --run: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"profile": described, "version_problems": problems,
                          "results": [asdict(r) for r in rows]}, indent=1))
    else:
        print(summary(rows))
    return 0 if all(r.passed for r in rows) else 1
