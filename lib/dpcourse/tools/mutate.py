"""Mutation testing of the labs: does each lab check catch a broken answer?

A lab check is only as good as the wrong answers it refuses. This module breaks each solution
on purpose — one small change inside a ``### BEGIN SOLUTION`` region at a time: a line removed,
an operator swapped — runs the solution's cells with that change, and reports which changes
every check let through (the *survivors*). A survivor is either a hole in a check, or a change
that does not alter behaviour (an *equivalent* mutant, e.g. ``<`` → ``<=`` on a boundary the
answer never meets); tests/test_lab_mutations.py lists the accepted ones with the reason.

Run from the repository root::

    python -m dpcourse mutate                 # every lab, every mutant (minutes)
    python -m dpcourse mutate lab03 lab06     # some labs
    python -m dpcourse mutate lab02 --list    # only list the mutants, run nothing

Each lab runs in a subprocess of its own (TensorFlow's logical devices, for lab05, can be set
only once per process). In it, the cells before the first solution region run once; then, for
each mutant, the cells from the first region on run again in a copy of that namespace, with the
mutated cell in place. A mutant is *caught* when any cell raises (a LabCheckError naming the
mistake, or any other error); a mutant that runs longer than ``--timeout`` seconds counts as
caught too (the learner would see a hang, then the check's timeout).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dpcourse.tools import authoring

__all__ = ["Mutant", "mutants", "run", "fingerprint", "main"]

# (what to look for, what to put instead): one mutant for the first match on each line.
SWAPS = [
    ("/=", "*="), ("*=", "/="), ("+=", "-="), (" / ", " * "), (" // ", " * "), (" * ", " / "),
    (" + ", " - "), (" - ", " + "), (" < ", " <= "), (" <= ", " < "), (" > ", " >= "),
    (" >= ", " > "), ("==", "!="), ("True", "False"), ("False", "True"), (".mean(", ".sum("),
    (".sum(", ".mean("), ("ReduceOp.SUM", "ReduceOp.MAX"), ("dim=0", "dim=-1"),
    ("(i + 1)", "(i)"), ("(i - 1)", "(i)"), ("- 1)", ")"), ("+ 1)", ")"),
]
_BEGIN = re.compile(r"^\s*### BEGIN SOLUTION")
_END = re.compile(r"^\s*### END SOLUTION")


@dataclass
class Mutant:
    lab: str
    cell: int  # index of the code cell in the solution notebook
    line: int  # line number inside that cell, from 1
    what: str  # e.g. "delete: p.grad /= world_size" or "swap '/=' -> '*=': ..."
    source: str  # the whole mutated cell

    @property
    def key(self) -> str:
        """A stable name for the mutant, used to list accepted (equivalent) survivors."""
        return f"{self.lab}:{self.what}"


def _compiles(source: str) -> bool:
    try:
        compile(_strip_magics(source), "<mutant>", "exec")
        return True
    except SyntaxError:
        return False


def _strip_magics(source: str) -> str:
    return "\n".join("pass" if l.lstrip().startswith(("%", "!")) else l
                     for l in source.splitlines())


def mutants(solution: Path) -> list[Mutant]:
    """Every single-line mutant of the solution regions of ``solution`` (a solutions/*.py)."""
    nb = authoring.read_source(solution)
    lab = solution.stem[:5]
    found: list[Mutant] = []
    for c, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "### BEGIN SOLUTION" not in cell.source:
            continue
        lines = cell.source.splitlines()
        inside = False
        for i, line in enumerate(lines):
            if _BEGIN.match(line):
                inside = True
                continue
            if _END.match(line):
                inside = False
                continue
            text = line.strip()
            if not inside or not text or text.startswith("#") or text.startswith(('"""', "'''")):
                continue
            indent = line[: len(line) - len(line.lstrip())]
            candidates = [(f"delete: {text}", indent + "pass")]
            code, sep, comment = line.partition("  #")  # never mutate an inline comment
            for old, new in SWAPS:
                if old in code:
                    candidates.append((f"swap {old.strip()!r} -> {new.strip()!r}: {text}",
                                       code.replace(old, new, 1) + sep + comment))
            for what, replacement in candidates:
                source = "\n".join(lines[:i] + [replacement] + lines[i + 1:])
                if _compiles(source):
                    found.append(Mutant(lab, c, i + 1, what, source))
    return found


# --------------------------------------------------------------------------------------------
# Running: one subprocess per lab
# --------------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def _exec_cells(cells: list[str], ns: dict, timeout: float) -> str | None:
    """Run ``cells`` in ``ns``; None if all ran, else a one-line reason for the first failure."""
    out = io.StringIO()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            for source in cells:
                if _run_cell_magic(source, ns):
                    continue
                exec(compile(_strip_magics(source), "<cell>", "exec"), ns)
        return None
    except _Timeout:
        return f"timed out after {timeout:.0f} s"
    except BaseException as err:  # a check's LabCheckError, or the mutant's own crash
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {first[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _run_cell_magic(source: str, ns: dict) -> bool:
    """Do what IPython would for a cell magic; True if the cell was one. ``%%writefile PATH``
    writes the rest of the cell to PATH ({name} expanded from the namespace, as IPython does);
    any other cell magic is skipped."""
    first, _, body = source.lstrip("\n").partition("\n")
    if not first.startswith("%%"):
        return False
    if first.startswith("%%writefile"):
        path = first.split(None, 1)[1].strip().format_map(ns)
        Path(path).write_text(body + ("\n" if not body.endswith("\n") else ""))
    return True


def _worker(solution: Path, chosen: list[dict], timeout: float, baseline: bool = True) -> None:
    """Subprocess body: print one JSON line per mutant (and one for the unmutated baseline)."""
    import os

    os.chdir(solution.parent)
    nb = authoring.read_source(solution)
    code = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"
            and "solution-only" not in c.metadata.get("tags", [])]
    # Cells only the solution has (e.g. deleting its scratch folder) run once, at the end.
    cleanup = [c.source for c in nb.cells if c.cell_type == "code"
               and "solution-only" in c.metadata.get("tags", [])]
    first = next(k for k, (_, s) in enumerate(code) if "### BEGIN SOLUTION" in s)
    prefix = {"__name__": "__main__"}
    failure = _exec_cells([s for _, s in code[:first]], prefix, timeout=300)
    if failure:
        print(json.dumps({"baseline": f"the cells before the first TODO failed: {failure}"}),
              flush=True)
        return
    rest = code[first:]
    t0 = time.perf_counter()
    failure = _exec_cells([s for _, s in rest], dict(prefix), timeout=300) if baseline else None
    print(json.dumps({"baseline": failure, "seconds": round(time.perf_counter() - t0, 2)}),
          flush=True)
    if failure:
        return
    for m in chosen:
        cells = [m["source"] if i == m["cell"] else s for i, s in rest]
        t0 = time.perf_counter()
        reason = _exec_cells(cells, dict(prefix), timeout)
        print(json.dumps({"what": m["what"], "caught": reason,
                          "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
    _exec_cells(cleanup, prefix, timeout=60)


def run(solution: Path, chosen: list[Mutant] | None = None, timeout: float = 60,
        total_timeout: float = 1800, baseline: bool = True) -> dict:
    """Run the mutants of one solution in a fresh subprocess.

    With ``baseline`` (the default) the unmutated solution runs first and must pass, or no
    mutant runs: a check that fails everything would otherwise "catch" every mutant. The suite
    turns it off where nbval has just run that very solution.

    Returns ``{"baseline": None or why the unmutated solution failed, "results": [{"what",
    "caught" (None if it survived), "seconds"}, ...]}``.
    """
    chosen = mutants(solution) if chosen is None else chosen
    payload = json.dumps({"solution": str(solution), "timeout": timeout, "baseline": baseline,
                          "mutants": [asdict(m) for m in chosen]})
    proc = subprocess.run([sys.executable, "-m", "dpcourse.tools.mutate", "--worker"],
                          input=payload, capture_output=True, text=True, timeout=total_timeout)
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    if not lines or "baseline" not in lines[0]:
        return {"baseline": f"the worker died (exit {proc.returncode}): {proc.stderr[-1500:]}",
                "results": []}
    results = lines[1:]
    if len(results) < len(chosen) and not lines[0]["baseline"]:
        done = {r["what"] for r in results}
        results += [{"what": m.what, "caught": f"the worker died (exit {proc.returncode})",
                     "seconds": None} for m in chosen if m.what not in done]
    return {"baseline": lines[0]["baseline"], "seconds": lines[0].get("seconds"),
            "results": results}


_CHECK_FILE = re.compile(r"^_?(lab\d\d)")  # checks/lab07.py, checks/_lab07_topk.py -> lab07
_CHECK_IMPORT = re.compile(r"^\s*from\s+(?:\.|dpcourse\.checks\.)(lab\d\d)\b", re.M)


def _lab_check_files(checks: Path, lab: str) -> set:
    """The check modules of ``lab`` and of every lab whose checks they import, transitively
    (lab 02's checks import lab 01's, lab 10's import lab 04's)."""
    by_lab: dict[str, list] = {}
    for f in checks.glob("*.py"):
        match = _CHECK_FILE.match(f.name)
        if match:
            by_lab.setdefault(match.group(1), []).append(f)
    wanted, todo = set(), [lab]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        for f in by_lab.get(name, []):
            todo += _CHECK_IMPORT.findall(f.read_text())
    return {f for name in wanted for f in by_lab.get(name, [])}


def fingerprint(solution: Path, *extra) -> str:
    """A hash of everything a mutation run of ``solution`` depends on: the solution's source,
    the library (a lab's checks import it, and its ranks import more of it in processes of
    their own, so all of it is hashed rather than a guess at what is used) — except the check
    modules of other labs, which its own checks do not import, and the course tooling in
    ``dpcourse.tools`` (the build, translations, the workshop: no check or rank imports it)
    other than this module, which makes the mutants — the versions of Python and torch, and
    ``extra`` (e.g. how the sample is drawn).

    The suite records it beside a sample that every check caught, and runs that sample again
    only when the fingerprint has changed: the same files give the same mutants and the same
    checks (tests/test_lab_mutations.py)."""
    import hashlib
    import platform

    import torch

    lib = Path(__file__).resolve().parents[1]
    checks = lib / "checks"
    own = _lab_check_files(checks, Path(solution).stem[:5])
    digest = hashlib.sha256()
    for part in (platform.python_version_tuple()[:2], torch.__version__, repr(extra)):
        digest.update(repr(part).encode())
    files = [(Path(solution).name, Path(solution))] + sorted(
        (str(f.relative_to(lib)), f) for f in lib.rglob("*")
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"
        and not (f.parent == checks and _CHECK_FILE.match(f.name) and f not in own)
        and not (f.parent == lib / "tools" and f.name != Path(__file__).name))
    for name, path in files:
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def main(argv: list[str] | None = None, prog: str = "python -m dpcourse mutate") -> int:
    """``python -m dpcourse mutate [labNN ...]`` (or ``-m dpcourse.tools.mutate``) comes here."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("labs", nargs="*", help="lab names or prefixes (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--timeout", type=float, default=60, help="seconds per mutant")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(sys.stdin.read())
        _worker(Path(job["solution"]), job["mutants"], job["timeout"], job.get("baseline", True))
        return 0
    solutions = [p for p in authoring.sources(names=args.labs or ["lab"])
                 if p.parent.name == "solutions"]
    report, survivors = {}, 0
    for solution in solutions:
        found = mutants(solution)
        if args.list:
            for m in found:
                print(f"{m.key}")
            continue
        t0 = time.perf_counter()
        result = run(solution, found, timeout=args.timeout)
        report[solution.stem] = result
        if args.json:
            continue
        if result["baseline"]:
            print(f"{solution.stem}: the unmutated solution fails: {result['baseline']}")
            survivors += 1
            continue
        alive = [r for r in result["results"] if not r["caught"]]
        survivors += len(alive)
        print(f"{solution.stem}: {len(found)} mutants, {len(found) - len(alive)} caught, "
              f"{len(alive)} survived ({time.perf_counter() - t0:.0f} s)")
        for r in alive:
            print(f"    survived: {r['what']}")
    if args.json:
        print(json.dumps(report, indent=1))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
