"""Lab 10's line tools (solutions/lab10_bug_hunt.py, "Fix it"): a fixed script is built from the
broken one by moving, deleting or inserting whole lines, each found by a piece that must match
exactly one line, so no indentation or line ending needs typing.

Exported by :mod:`dpcourse.checks.lab10`, where the lab calls them.
"""

from __future__ import annotations

__all__ = ["move_line", "delete_line", "insert_line"]


def move_line(text: str, line: str, before: str) -> str:
    """``text`` with the one line that contains ``line`` moved to just before the one line that
    contains ``before``, re-indented like that line. Each must match exactly one line (a
    ``ValueError`` says how many matched otherwise), so no exact indentation or line ending
    needs typing: ``move_line(broken, "clip_grad_norm_", before="opt.step()")``."""
    lines = text.splitlines(keepends=True)
    src, dst = _only_line(lines, line, "line"), _only_line(lines, before, "before")
    if src == dst:
        raise ValueError("line and before match the same line")
    moved = lines.pop(src)
    dst = dst - (src < dst)
    indent = lines[dst][:len(lines[dst]) - len(lines[dst].lstrip())]
    body = moved.strip("\r\n").lstrip()
    ending = moved[len(moved.rstrip("\r\n")):] or "\n"
    lines.insert(dst, indent + body + ending)
    return "".join(lines)


def _only_line(lines: list[str], part, name: str) -> int:
    if not isinstance(part, str) or not part.strip():
        raise ValueError(f"{name} must be a non-empty piece of one line; got {part!r}")
    hits = [i for i, ln in enumerate(lines) if part in ln]
    if len(hits) != 1:
        raise ValueError(f"{name}={part!r} must match exactly one line; it matches "
                         f"{len(hits)}" + (f" (lines {[i + 1 for i in hits]})" if hits else ""))
    return hits[0]


def delete_line(text: str, line: str) -> str:
    """``text`` without the one line that contains ``line`` (a ``ValueError`` if it matches no
    line or several)."""
    lines = text.splitlines(keepends=True)
    del lines[_only_line(lines, line, "line")]
    return "".join(lines)


def insert_line(text: str, new: str, before: str) -> str:
    """``text`` with ``new`` inserted as a whole line just before the one line that contains
    ``before``, indented like that line (no exact indentation or line ending to type)."""
    if not isinstance(new, str) or not new.strip() or "\n" in new.strip("\r\n"):
        raise ValueError(f"new must be one line of code; got {new!r}")
    lines = text.splitlines(keepends=True)
    dst = _only_line(lines, before, "before")
    indent = lines[dst][:len(lines[dst]) - len(lines[dst].lstrip())]
    ending = lines[dst][len(lines[dst].rstrip("\r\n")):] or "\n"
    lines.insert(dst, indent + new.strip() + ending)
    return "".join(lines)
