"""lessons/HANDOUT.md, the learners' one page, says only what is true of this library.

Its Python blocks are run here, in order, in one namespace (two launches of 2 gloo ranks, about
15 s); what a block prints is compared with the comment beside it; every call the page names in
running text (``dist.all_reduce(...)``, ``launch.spawn``) resolves to a real function; its
links point at files that exist; the command it gives exists with its option; and it fits on
one page.
"""

from __future__ import annotations

import ast
import contextlib
import io
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HANDOUT = ROOT / "lessons" / "HANDOUT.md"


def text() -> str:
    return HANDOUT.read_text(encoding="utf-8")


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", text(), flags=re.S)


@pytest.fixture(scope="module")
def ran():
    """The namespace after every block ran, and what each block printed."""
    namespace = {"__name__": "handout"}  # not importable: launch ships functions by value
    printed = []
    for block in blocks():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(HANDOUT), "exec"), namespace)  # noqa: S102
        printed.append(out.getvalue())
    return namespace, printed


def test_the_page_has_the_collectives_the_worker_and_the_ring():
    assert len(blocks()) == 3
    for title in ("## The collectives", "## The DDP worker skeleton",
                  "## The ring all-reduce, step by step", "## Where things are"):
        assert title in text()


def test_every_block_runs_and_prints_what_its_comment_says(ran):
    _, printed = ran
    for block, out in zip(blocks(), printed):
        for line in block.splitlines():
            m = re.match(r"print\((.*)\)\s+#\s*(\[.*)$", line)
            if m:  # a print whose comment is a Python value: the value printed
                assert ast.literal_eval(out.strip().splitlines()[0]) == eval(m.group(2)), line
    collectives, worker, ring = printed
    assert ast.literal_eval(collectives.strip()) == [(3.0, [1.0, 2.0])] * 2
    losses = ast.literal_eval(worker.strip())
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert ring.startswith("step 1 (reduce-scatter): w0->w1: chunk 0")


def test_every_call_named_in_the_text_is_a_real_function(ran):
    namespace, _ = ran
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text(), flags=re.S))
    named = 0
    for span in spans:
        m = re.match(r"([A-Za-z_][\w.]*)(\(|$)", span)
        if not m or "." not in m.group(1):
            continue
        head, *rest = m.group(1).split(".")
        if head not in namespace:
            continue
        obj = namespace[head]
        for attr in rest:
            assert hasattr(obj, attr), f"`{span}`: {m.group(1)} does not exist"
            obj = getattr(obj, attr)
        if m.group(2):
            assert callable(obj), f"`{span}` is not a function"
        named += 1
    assert named >= 8, named


def test_links_and_the_command_exist():
    for target in re.findall(r"\]\(([^)\s#]+)\)", text()):
        assert (HANDOUT.parent / target).resolve().exists(), target
    from dpcourse.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["diagnose", "--help"])
    assert "python -m dpcourse diagnose --timeout" in text() and "--timeout" in out.getvalue()


def test_it_fits_on_one_page():
    lines = text().splitlines()
    assert len(lines) <= 100, f"{len(lines)} lines: a handout is one page"
    assert max(len(line) for line in lines if not line.startswith("|")) <= 100
