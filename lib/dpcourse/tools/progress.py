"""The class's progress, from the lab checks' shared log: ``python -m dpcourse progress PATH``.

When ``DPCOURSE_PROGRESS=PATH`` is in a learner's environment (a JupyterHub spawner sets it for
everyone), every lab check appends one JSON line to PATH: learner, lab, check, passed or the
short form of the mistake it named, the whole sentence, time (``dpcourse.checks.recorded``).
This module reads that file and prints what an instructor needs during a lab:

* the class table: one row per learner, one column per check that anyone has run, each cell
  the learner's LATEST attempt (``✔``, or the short mistake) and how many attempts they made;
* the mistake most learners are stuck on right now, with the check's whole sentence: the thing
  to say out loud to the room;
* what the room predicted before each measurement (``dpcourse.checks.predict``): the values,
  counted, beside the measured one — the misconception to talk about before the lab goes on.

    python -m dpcourse progress /srv/dpcourse/progress.jsonl            # the table
    python -m dpcourse progress PATH --lab lab03 --cell 40               # one lab, wider cells
    python -m dpcourse progress PATH --json                              # the same, as data
    watch -n 15 python -m dpcourse progress PATH                         # live, during a lab

Lines that cannot be read (a torn write, a hand edit) are skipped and counted, never fatal.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Attempts", "read_log", "summarize", "most_common", "predictions", "render", "main"]

_RECORD_START = '{"learner":'  # every line the checks write starts with this key
_OUTCOME_CELL = {"todo": "TODO not filled", "interrupted": "stopped"}


@dataclass
class Attempts:
    """One learner's attempts at one check: how many, and the latest one's record."""

    count: int = 0
    latest: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.latest.get("passed"))

    def cell(self, width: int) -> str:
        outcome = self.latest.get("outcome")
        if outcome in ("predicted", "compared"):  # a prediction: its value, then right or not
            text = f"→ {self.latest.get('predicted')}"
            if outcome == "compared":
                text += " ✔" if self.latest.get("close") else f" ✗ ({self.latest.get('measured')})"
            return text[:width]
        if self.passed:
            text = "✔"
        else:
            outcome = self.latest.get("outcome", "mistake")
            text = _OUTCOME_CELL.get(outcome) or self.latest.get("mistake") or outcome
            if len(text) > width:  # cut at a word, as checks.short_mistake does
                text = text[: width - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"
        return f"{text} ({self.count})" if self.count > 1 else text


def _parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        # A line a crash tore off before its newline has the next record glued to its end:
        # keep the last whole record on the line.
        start = line.rfind(_RECORD_START)
        if start <= 0:
            return None
        try:
            record = json.loads(line[start:])
        except ValueError:
            return None
    if not isinstance(record, dict) or not all(
            isinstance(record.get(k), str) and record.get(k) for k in ("learner", "lab", "check")):
        return None
    return record


def read_log(path) -> tuple[list[dict], int]:
    """The records in ``path`` in file order, and how many lines could not be read."""
    records, skipped = [], 0
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            record = _parse(line)
            if record is None:
                skipped += 1
            else:
                records.append(record)
    return records, skipped


def check_label(record: dict) -> str:
    """The column a record belongs to: its lab and check, e.g. ``lab03 average_gradients``."""
    return f"{record['lab']} {record['check'].removeprefix('check_')}"


def summarize(records: list[dict], labs=None) -> tuple[list[str], list[str], dict]:
    """Learners (sorted), checks (by lab, then by first attempt) and, per (learner, check),
    the :class:`Attempts`. Records are taken in file order, which is time order."""
    cells: dict[tuple[str, str], Attempts] = {}
    first_seen: dict[str, int] = {}
    for i, record in enumerate(records):
        if labs and record["lab"] not in labs:
            continue
        label = check_label(record)
        first_seen.setdefault(label, i)
        attempts = cells.setdefault((record["learner"], label), Attempts())
        attempts.count += 1
        attempts.latest = record
    learners = sorted({who for who, _ in cells})
    checks = sorted(first_seen, key=lambda c: (c.split(" ", 1)[0], first_seen[c]))
    return learners, checks, cells


def most_common(cells: dict) -> list[tuple[str, str, int, str]]:
    """The mistakes learners are stuck on now (their latest attempt at a check failed with
    it), most learners first: ``(check, short mistake, learners, one whole sentence)``."""
    stuck: Counter = Counter()
    sentence: dict = {}
    for (_, label), attempts in cells.items():
        record = attempts.latest
        if attempts.passed or record.get("outcome") != "mistake":
            continue
        key = (label, record.get("mistake", ""))
        stuck[key] += 1
        sentence.setdefault(key, record.get("message", ""))
    ranked = sorted(stuck.items(), key=lambda kv: (-kv[1], kv[0]))
    return [(label, short, n, sentence[(label, short)]) for (label, short), n in ranked]


def render(records: list[dict], skipped: int = 0, labs=None, width: int = 30,
           top: int = 3) -> str:
    """The class table and the most common mistakes, as text."""
    learners, checks, cells = summarize(records, labs)
    if not checks:
        scope = f" for {', '.join(labs)}" if labs else ""
        return f"No checks recorded yet{scope}." + _skipped_note(skipped)
    last = {who: "" for who in learners}
    for (who, _), attempts in cells.items():
        last[who] = max(last[who], str(attempts.latest.get("time", "")))
    header = ["learner", *checks, "last check"]
    rows = []
    for who in learners:
        row = [who]
        for label in checks:
            attempts = cells.get((who, label))
            row.append(attempts.cell(width) if attempts else "·")
        row.append(last[who][11:16] or "?")  # HH:MM of an ISO time
        rows.append(row)
    passed = ["passed"]
    for label in checks:
        n = sum(1 for who in learners if (who, label) in cells and cells[who, label].passed)
        passed.append(f"{n}/{len(learners)}")
    passed.append("")
    widths = [max(len(r[i]) for r in [header, *rows, passed]) for i in range(len(header))]

    def line(cols):
        return "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [f"{len(learners)} learner(s), {len(records)} check run(s); each cell: the latest "
           f"attempt (✔ or the mistake), (n) attempts when more than one, · not tried yet.", "",
           line(header), rule, *map(line, rows), rule, line(passed), ""]
    out.extend(prediction_lines(cells))
    common = most_common(cells)
    if common:
        label, short, n, sentence = common[0]
        out.append(f"Most common mistake now: {label}: \"{short}\" — the latest attempt of "
                   f"{n} of {len(learners)} learner(s).")
        out.append(f"  The check says: {sentence}")
        for label, short, n, _ in common[1:top]:
            out.append(f"  then {label}: \"{short}\" ({n})")
    else:
        out.append("Nobody is stuck on a mistake right now.")
    return "\n".join(out) + _skipped_note(skipped)


def predictions(cells: dict) -> list[dict]:
    """What the room predicted, per prediction question (``predict ...`` columns): each
    learner's latest prediction counted by value, the measured value where a check compared it,
    and how many were right."""
    questions: dict[str, dict] = {}
    for (_, label), attempts in cells.items():
        record = attempts.latest
        if record.get("outcome") not in ("predicted", "compared"):
            continue
        q = questions.setdefault(label, {"check": label, "values": Counter(), "measured": None,
                                         "compared": 0, "close": 0})
        q["values"][str(record.get("predicted"))] += 1
        if record.get("outcome") == "compared":
            q["compared"] += 1
            q["close"] += bool(record.get("close"))
            q["measured"] = record.get("measured")
            if "how" in record:   # a value a model computed, not a run (lab 06's time per step)
                q["how"] = record["how"]
    return [questions[k] for k in sorted(questions)]


def prediction_lines(cells: dict) -> list[str]:
    lines = []
    for q in predictions(cells):
        values = ", ".join(f"{v} ×{n}" for v, n in q["values"].most_common())
        measured = f" ({q.get('how', 'measured')} {q['measured']}; {q['close']} of " \
                   f"{q['compared']} right)" \
            if q["compared"] else ""
        lines.append(f"The room predicted, {q['check']}: {values}{measured}.")
    return lines + ([""] if lines else [])


def _skipped_note(skipped: int) -> str:
    return (f"\n({skipped} line(s) could not be read and were skipped: a torn write or a hand "
            f"edit.)" if skipped else "")


def as_json(records: list[dict], skipped: int, labs=None) -> dict:
    learners, checks, cells = summarize(records, labs)
    return {
        "learners": learners,
        "checks": checks,
        "cells": {who: {label: {"passed": cells[who, label].passed,
                                "mistake": cells[who, label].latest.get("mistake", ""),
                                "outcome": cells[who, label].latest.get("outcome", ""),
                                "attempts": cells[who, label].count,
                                "time": cells[who, label].latest.get("time", "")}
                        for label in checks if (who, label) in cells} for who in learners},
        "most_common": [{"check": c, "mistake": m, "learners": n, "sentence": s}
                        for c, m, n, s in most_common(cells)],
        "predictions": [dict(q, values=dict(q["values"])) for q in predictions(cells)],
        "skipped_lines": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpcourse progress",
        description="The class table from the file the lab checks append to when "
                    "DPCOURSE_PROGRESS names it: learners x checks, each cell the latest "
                    "attempt, and the mistake most learners are stuck on now.")
    parser.add_argument("path", help="the progress file (DPCOURSE_PROGRESS)")
    parser.add_argument("--lab", action="append", metavar="LABNN",
                        help="only this lab's checks, e.g. --lab lab03 (repeatable)")
    parser.add_argument("--cell", type=int, default=30, metavar="N",
                        help="characters of a mistake shown in a cell (default 30)")
    parser.add_argument("--json", action="store_true", help="the same, as JSON")
    args = parser.parse_args(argv)
    if args.cell < 8:
        parser.error(f"--cell must be at least 8 characters, got {args.cell}")
    labs = None
    if args.lab:
        numbers = [lab.lower().removeprefix("lab") for lab in args.lab]
        if not all(n.isdigit() for n in numbers):
            parser.error(f"--lab takes a lab's name or number (lab03, lab3 or 3), got {args.lab}")
        labs = {f"lab{int(n):02d}" for n in numbers}
    path = Path(args.path)
    if not path.is_file():
        print(f"no progress file at {path}: no check has run with DPCOURSE_PROGRESS={path} "
              f"yet (or the path differs from the one the learners' servers have)",
              file=sys.stderr)
        return 2
    records, skipped = read_log(path)
    if args.json:
        print(json.dumps(as_json(records, skipped, labs), indent=1, ensure_ascii=False))
    else:
        print(render(records, skipped, labs, width=args.cell))
    return 0


if __name__ == "__main__":
    sys.exit(main())
