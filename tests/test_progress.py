"""The class's progress: every lab check appends one JSON line to DPCOURSE_PROGRESS, and
``python -m dpcourse progress PATH`` turns the file into the instructor's table.

Proven here: learners in separate processes writing at the same moment lose and mix no line;
a torn or unreadable line is skipped and counted, and a record glued to a torn one is kept; an
unwritable file never changes what a check prints or raises; the table holds each learner's
latest attempt and the attempt count; the most common mistake is the one most learners' latest
attempt names; a check called by another check is recorded once; the learner's name comes from
DPCOURSE_LEARNER, then JUPYTERHUB_USER, then the OS user. And lab checks' timeouts:
``timeout=`` wins, DPCOURSE_CHECK_TIMEOUT raises every default, and a timeout's message says
it may be slowness as well as naming the deadlock.
"""

from __future__ import annotations

import contextlib
import getpass
import io
import json
import multiprocessing
import os
import time

import pytest

from dpcourse import checks
from dpcourse.checks import LabCheckError, lab06, lab10
from dpcourse.tools import progress

LONG = "x" * 300  # long messages make an interleaved write easy to see


def _make_check(lab: str, name: str, body):
    """A check that lives in lab ``lab`` (as the real ones do, its lab is its module's)."""
    def check(*args):
        return body(*args)

    check.__module__ = f"dpcourse.checks.{lab}"
    check.__name__ = check.__qualname__ = name
    return checks.recorded(check)


def _ok(_answer=None):
    checks.passed("fine")


def _wrong(_answer=None):
    checks.fail(f"you divided by a fixed 2: divide by dist.get_world_size() {LONG}")


def _learner_process(path: str, learner: str, n: int, start) -> None:
    os.environ["DPCOURSE_PROGRESS"] = path
    os.environ["DPCOURSE_LEARNER"] = learner
    ok = _make_check("lab03", "check_average_gradients", _ok)
    wrong = _make_check("lab03", "check_average_gradients", _wrong)
    start.wait(30)
    with contextlib.redirect_stdout(io.StringIO()):
        for i in range(n):
            try:
                (ok if i % 2 else wrong)()
            except LabCheckError:
                pass


@pytest.fixture
def log(tmp_path, monkeypatch):
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv("DPCOURSE_PROGRESS", str(path))
    monkeypatch.setenv("DPCOURSE_LEARNER", "ana")
    monkeypatch.delenv("DPCOURSE_CHECK_TIMEOUT", raising=False)
    return path


def _as(monkeypatch, learner: str) -> None:
    monkeypatch.setenv("DPCOURSE_LEARNER", learner)


def _table(path, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert progress.main([str(path), *args]) == 0
    return out.getvalue()


# --- writing -------------------------------------------------------------------------------


def test_many_learners_writing_at_once_lose_and_mix_no_line(tmp_path):
    path = tmp_path / "class.jsonl"
    learners, n = 8, 150
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_learner_process, args=(str(path), f"learner{k:02d}", n, start))
             for k in range(learners)]
    for p in procs:
        p.start()
    time.sleep(0.5)
    start.set()  # every learner starts writing at the same moment
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * learners
    raw = path.read_bytes().decode().split("\n")
    assert raw[-1] == "" and all(raw[:-1]), "every line ends with a newline, none is empty"
    records = [json.loads(line) for line in raw[:-1]]  # every line is one whole record
    assert len(records) == learners * n
    per = {}
    for r in records:
        per.setdefault(r["learner"], []).append(r["passed"])
    assert sorted(per) == [f"learner{k:02d}" for k in range(learners)]
    for outcomes in per.values():  # each learner's lines in the order they wrote them
        assert outcomes == [bool(i % 2) for i in range(n)]
    recs, skipped = progress.read_log(path)
    assert len(recs) == learners * n and skipped == 0


def test_a_record_holds_learner_lab_check_outcome_mistake_and_time(log):
    lab06.check_scatter_reduce(lab06.reference_scatter_reduce)
    with pytest.raises(LabCheckError):
        lab06.check_scatter_reduce(lambda buffers: None)
    first, second = (json.loads(line) for line in log.read_text().splitlines())
    assert list(first)[0] == "learner"  # the reader finds a record's start by it
    assert (first["learner"], first["lab"], first["check"]) == ("ana", "lab06",
                                                                 "check_scatter_reduce")
    assert first["passed"] and first["outcome"] == "passed" and first["mistake"] == ""
    assert first["time"].endswith("+00:00") and first["seconds"] >= 0
    assert not second["passed"] and second["outcome"] == "mistake"
    assert second["mistake"] == "scatter_reduce left the buffers unchanged (N=3)"
    assert second["message"].startswith(second["mistake"] + ": nothing a worker received")


def test_short_mistake_is_the_first_clause_within_60_characters():
    assert checks.short_mistake("gradients from earlier batches leaked into each step: call "
                                "optimizer.zero_grad()") == \
        "gradients from earlier batches leaked into each step"
    assert checks.short_mistake("rank(s) 0, 1 never finished within 6 s — a deadlock: x") == \
        "rank(s) 0, 1 never finished within 6 s"
    long = checks.short_mistake("word " * 40)
    assert len(long) <= 60 and long.endswith("…")


def test_nothing_is_written_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("DPCOURSE_PROGRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    lab06.check_scatter_reduce(lab06.reference_scatter_reduce)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["a directory", "a missing folder", "a file as folder"])
def test_an_unwritable_file_never_changes_what_the_check_does(tmp_path, monkeypatch, capsys,
                                                              where):
    target = {"a directory": tmp_path,
              "a missing folder": tmp_path / "nowhere" / "progress.jsonl",
              "a file as folder": tmp_path / "plain" / "progress.jsonl"}[where]
    (tmp_path / "plain").write_text("")
    monkeypatch.setenv("DPCOURSE_PROGRESS", str(target))
    monkeypatch.setattr(checks, "_write_problems", set())
    lab06.check_scatter_reduce(lab06.reference_scatter_reduce)
    with pytest.raises(LabCheckError, match="left the buffers unchanged"):
        lab06.check_scatter_reduce(lambda buffers: None)
    lab06.check_all_gather(lab06.reference_all_gather)
    out, err = capsys.readouterr()
    assert out.count("✔") == 2
    assert err.count("could not be recorded") == 1, "one note per file, not one per check"


def test_a_check_called_by_another_check_is_recorded_once(log):
    inner = _make_check("lab04", "check_f1", _ok)

    def outer_body():
        inner()
        checks.passed("all")

    outer = _make_check("lab04", "check", outer_body)
    with contextlib.redirect_stdout(io.StringIO()):
        outer()
        inner()
    assert [json.loads(line)["check"] for line in log.read_text().splitlines()] == \
        ["check", "check_f1"]


def test_todo_and_errors_are_recorded_and_raised_unchanged(log):
    def unfilled(buffers):
        raise NotImplementedError("TODO: reduce-scatter")

    with pytest.raises(NotImplementedError):
        lab06.check_scatter_reduce(unfilled)
    with pytest.raises(ValueError, match="five bugs"):
        lab10.check_answer(9, "A")
    todo, error = (json.loads(line) for line in log.read_text().splitlines())
    assert todo["outcome"] == "todo" and not todo["passed"]
    assert error["outcome"] == "error" and error["check"] == "check_answer 9"


def test_the_learner_is_named_by_the_environment(log, monkeypatch):
    assert checks.learner() == "ana"
    monkeypatch.delenv("DPCOURSE_LEARNER")
    monkeypatch.setenv("JUPYTERHUB_USER", "ben")
    assert checks.learner() == "ben"
    monkeypatch.delenv("JUPYTERHUB_USER")
    assert checks.learner() == getpass.getuser()


# --- reading: the table -----------------------------------------------------------------------


def _class(log, monkeypatch):
    """Four learners at lab 06 and lab 10; the latest attempts: ana passed everything after a
    mistake, ben and cy are stuck on the unchanged buffers, dee on a wrong answer to bug 1."""
    def unchanged(buffers):
        return None

    for who, answers in [("ana", [unchanged, lab06.reference_scatter_reduce]),
                         ("ben", [unchanged, unchanged, unchanged]),
                         ("cy", [lab06.reference_scatter_reduce, unchanged]),
                         ("dee", [lab06.reference_scatter_reduce])]:
        _as(monkeypatch, who)
        for fn in answers:
            with contextlib.suppress(LabCheckError), contextlib.redirect_stdout(io.StringIO()):
                lab06.check_scatter_reduce(fn)
    for who, letter in [("ana", "B"), ("dee", "A")]:
        _as(monkeypatch, who)
        with contextlib.suppress(LabCheckError), contextlib.redirect_stdout(io.StringIO()):
            lab10.check_answer(1, letter)


def test_the_table_shows_each_learners_latest_attempt_and_count(log, monkeypatch):
    _class(log, monkeypatch)
    text = _table(log)
    print(text)
    rows = {line.split()[0]: line for line in text.splitlines()
            if line.split()[:1] and line.split()[0] in {"ana", "ben", "cy", "dee", "learner",
                                                        "passed"}}
    assert rows["learner"].split()[1:5] == ["lab06", "scatter_reduce", "lab10", "answer"]
    assert rows["ana"].split()[1:4] == ["✔", "(2)", "✔"]
    assert "scatter_reduce left the… (3)" in rows["ben"]  # cut at a word, 30 characters
    assert "scatter_reduce left the… (2)" in rows["cy"]
    assert "·" in rows["ben"] and "·" in rows["cy"], "ben and cy never tried lab 10"
    assert rows["dee"].split()[1] == "✔" and "Bug 1 is not A" in rows["dee"]
    assert rows["passed"].split()[1:] == ["2/4", "1/4"]


def test_the_most_common_mistake_is_the_latest_attempt_of_most_learners(log, monkeypatch):
    _class(log, monkeypatch)
    text = _table(log)
    line = next(t for t in text.splitlines() if t.startswith("Most common mistake now"))
    assert 'lab06 scatter_reduce: "scatter_reduce left the buffers unchanged (N=3)"' in line
    assert "2 of 4 learner(s)" in line  # ben and cy; ana's mistake is behind her
    said = text.splitlines()[text.splitlines().index(line) + 1]
    assert "nothing a worker received reached its own array" in said
    assert "then lab10 answer 1:" in text  # dee's wrong letter, one learner
    data = json.loads(_table(log, "--json"))
    assert [(m["check"], m["learners"]) for m in data["most_common"]] == \
        [("lab06 scatter_reduce", 2), ("lab10 answer 1", 1)]
    assert data["cells"]["ben"]["lab06 scatter_reduce"]["attempts"] == 3


def test_lab_filter_and_wider_cells(log, monkeypatch):
    _class(log, monkeypatch)
    text = _table(log, "--lab", "6", "--cell", "60")
    assert "lab10" not in text
    assert "scatter_reduce left the buffers unchanged (N=3) (3)" in text
    assert _table(log, "--lab", "lab6", "--cell", "60") == text
    assert _table(log, "--lab", "lab06", "--cell", "60") == text
    assert "lab06" not in _table(log, "--lab", "10")
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        progress.main([str(log), "--lab", "ring"])


def test_a_torn_file_is_read_what_can_be_read(log, monkeypatch):
    _class(log, monkeypatch)
    good = log.read_bytes()
    # A learner's process killed mid-write leaves half a line; the next record is glued to it.
    log.write_bytes(good + b'{"learner": "eve", "lab": "lab06", "che')
    _as(monkeypatch, "eve")
    lab06.check_scatter_reduce(lab06.reference_scatter_reduce)
    with open(log, "ab") as f:
        f.write(b"not json at all\n\xff\xfe\n")
    records, skipped = progress.read_log(log)
    assert skipped == 2
    assert records[-1]["learner"] == "eve" and records[-1]["passed"]
    text = _table(log)
    assert "eve" in text and "2 line(s) could not be read" in text


def test_an_empty_or_missing_file(log, tmp_path, capsys):
    assert progress.main([str(tmp_path / "none.jsonl")]) == 2
    assert "no progress file" in capsys.readouterr().err
    log.write_text("")
    assert "No checks recorded yet." in _table(log)


def test_the_progress_subcommand(log, monkeypatch, capsys):
    from dpcourse.__main__ import main

    _class(log, monkeypatch)
    assert main(["progress", str(log)]) == 0
    assert "Most common mistake now" in capsys.readouterr().out


# --- timeouts --------------------------------------------------------------------------------


def test_timeout_keyword_environment_and_defaults(monkeypatch):
    monkeypatch.delenv("DPCOURSE_CHECK_TIMEOUT", raising=False)
    assert checks.check_timeout(None, 20.0) == 20.0
    assert checks.check_timeout(5, 20.0) == 5.0  # the learner's keyword wins
    monkeypatch.setenv("DPCOURSE_CHECK_TIMEOUT", "120")
    assert checks.check_timeout(None, 20.0) == 120.0  # the class-wide setting raises it
    assert checks.check_timeout(None, 300.0) == 300.0  # and never lowers a longer default
    assert checks.check_timeout(5, 20.0) == 5.0
    monkeypatch.setenv("DPCOURSE_CHECK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DPCOURSE_CHECK_TIMEOUT='soon' is not a number"):
        checks.check_timeout(None, 20.0)
    with pytest.raises(ValueError, match="positive number"):
        checks.check_timeout(0, 20.0)


def _hang_on_rank0(rank, world_size):
    if rank == 0:
        time.sleep(60)


def _hang_on_both(rank, world_size):
    time.sleep(60)


def test_a_timeout_says_deadlock_and_slowness(log):
    """Nobody returned: the check cannot tell a deadlock from a slow machine, so it says both and
    shows where the longer timeout goes (the check's own call)."""
    with pytest.raises(LabCheckError) as info:
        checks.run_ranks(_hang_on_both, 2, timeout=3, backend=None,
                         hang="every rank must call the same collectives.")
    message = info.value.message
    assert message.startswith("rank(s) 0, 1 never finished within 3 s — a deadlock: every rank")
    assert ("no answer within 3 s — on a crowded server this may be slowness: run the check "
            "again with a longer timeout, timeout=120") in message
    assert checks.slowness(120).endswith("timeout=240")

    check = _make_check("lab03", "check_hang", lambda: checks.run_ranks(
        _hang_on_both, 2, timeout=2, backend=None, hang="x."))
    with pytest.raises(LabCheckError, match=r"check_hang\(\.\.\., timeout=120\)"):
        check()


def test_a_diagnosed_deadlock_does_not_suggest_slowness(log):
    """A rank still waiting after its peer returned waits for a collective the peer will never
    call: no longer timeout helps, and the sentence does not send the learner to find one."""
    with pytest.raises(LabCheckError) as info:
        checks.run_ranks(_hang_on_rank0, 2, timeout=3, backend=None,
                         hang="every rank must call the same collectives.")
    message = info.value.message
    assert message.startswith("rank(s) 0 never finished within 3 s — a deadlock: every rank")
    assert "rank(s) 1 had already returned, so no longer timeout can help" in message
    assert "slowness" not in message and "timeout=" not in message


# --- predictions -----------------------------------------------------------------------------


def test_a_prediction_is_validated_recorded_and_revealed(log, capsys):
    guess = checks.predict("lab07", "all-reduces in one step", 3, unit="all-reduces")
    assert guess == checks.Prediction("lab07", "all-reduces in one step", 3, "all-reduces")
    assert capsys.readouterr().out == ("Prediction recorded — all-reduces in one step: 3 "
                                       "all-reduces. Now run the measurement.\n")
    checks.reveal(guess, 2, close=False, explanation="The first bucket holds two parameters.")
    out = capsys.readouterr().out
    assert out.startswith("Your prediction: 3 all-reduces; measured: 2 all-reduces — not what "
                          "happened.\nThe first bucket")
    first, second = [json.loads(line) for line in log.read_text().splitlines()]
    assert (first["outcome"], first["predicted"], first["mistake"]) == ("predicted", 3, "")
    assert (second["outcome"], second["measured"], second["close"]) == ("compared", 2, False)
    assert first["check"] == second["check"] == "predict all-reduces in one step"


def test_a_prediction_written_after_its_measurement_is_compared_but_not_recorded(log, capsys):
    """A learner who saw the measurement and predicts again has no prediction left to make: the
    check still compares the new value, but the class's table keeps the first one."""
    first = checks.predict("lab03", "calls", 5)
    checks.reveal(first, 10, close=False, explanation="")
    capsys.readouterr()
    again = checks.predict("lab03", "calls", 10)
    assert again.late and "your first prediction, 5, is the one kept" in capsys.readouterr().out
    checks.reveal(again, 10, close=True, explanation="")
    assert capsys.readouterr().out.startswith("Your prediction (made after the measurement was "
                                              "shown): 10; measured: 10 — right.")
    outcomes = [json.loads(line)["outcome"] for line in log.read_text().splitlines()]
    assert outcomes == ["predicted", "compared"]
    other = checks.predict("lab03", "another question", 1)  # other questions are untouched
    assert not other.late


def test_a_kept_decision_is_the_first_compared_and_forget_starts_afresh(log, capsys):
    """checks.keep records silently, once per question; wrong_answers is a per-question list a
    check appends to; forget() is a fresh kernel for all three memories."""
    assert checks.kept_prediction("lab06", "in flight") is None
    first = checks.Prediction("lab06", "in flight", 2, "receive(s)")
    checks.keep(first, 2, close=True)
    checks.keep(checks.Prediction("lab06", "in flight", 4), 4, close=True)  # not kept
    assert checks.kept_prediction("lab06", "in flight") == first
    assert capsys.readouterr().out == ""
    (line,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert (line["check"], line["predicted"], line["close"]) == ("predict in flight", 2, True)
    checks.wrong_answers("lab11", "passes").append(("both", "both"))
    assert checks.wrong_answers("lab11", "passes") == [("both", "both")]
    assert checks.wrong_answers("lab11", "other") == []
    checks.forget()
    assert checks.kept_prediction("lab06", "in flight") is None
    assert checks.wrong_answers("lab11", "passes") == []


@pytest.mark.parametrize("value, words", [
    (None, "write your prediction"), (..., "write your prediction"),
    ("3", "must be a number"), (True, "must be a number"), (float("nan"), "finite"),
])
def test_a_prediction_that_is_not_a_number_is_refused(log, value, words):
    with pytest.raises((LabCheckError, NotImplementedError), match=words):
        checks.predict("lab07", "q", value)
    with pytest.raises(LabCheckError, match="not one of the choices"):
        checks.predict("lab07", "q", "maybe", choices=["grows", "shrinks"])
    assert checks.predict("lab07", "q", "grows", choices=["grows", "shrinks"]).value == "grows"
    with pytest.raises(LabCheckError, match="the Prediction that predict"):
        checks.reveal(3, 3, close=True, explanation="")


def test_the_table_shows_what_the_room_predicted(log, monkeypatch):
    for who, value in [("ana", 3), ("bo", 2), ("cy", 3)]:
        _as(monkeypatch, who)
        with contextlib.redirect_stdout(io.StringIO()):
            guess = checks.predict("lab07", "all-reduces in one step", value)
            if who != "cy":
                checks.reveal(guess, 3, close=value == 3, explanation="")
    table = _table(log)
    assert "→ 3 ✔" in table and "→ 2 ✗ (3)" in table and "→ 3" in table
    assert ("The room predicted, lab07 predict all-reduces in one step: 3 ×2, 2 ×1 (measured 3; "
            "1 of 2 right).") in table
    assert "Nobody is stuck on a mistake right now." in table  # predictions are not mistakes


def test_the_library_answer_is_refused_as_the_learners():
    from dpcourse import train

    with pytest.raises(LabCheckError, match=r"library's own reference answer "
                                            r"\(dpcourse\.train\.train_one_epoch\)"):
        checks.refuse_reference(train.train_one_epoch, "train_one_epoch", train.train_one_epoch)
    checks.refuse_reference(lambda: None, "train_one_epoch", train.train_one_epoch)


def test_a_check_in_a_labs_split_module_is_recorded_under_its_lab(log):
    """checks/_lab11_decisions.py holds lab 11's no-code decisions: the instructor's table
    counts them under lab11, not under the module's name."""
    from dpcourse.checks import lab11

    lab11.check_diagnosis("backward", "forward")
    (line,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert (line["lab"], line["outcome"]) == ("lab11", "passed")
