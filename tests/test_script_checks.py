"""``python -m dpcourse diagnose`` on a learner's own script (dpcourse.script_checks).

The corpus in tests/scripts/diagnose/ was written after the patterns of public DDP tutorials
and blog posts. Each script must get exactly the findings listed here — every mistake it has,
named with the script's file:line, the fix and a lesson, and nothing it does not have; the
correct script gets "nothing found". GPU-only scripts on this CPU machine are told what to
change, and run under ``--cpu``. Bad input gets one sentence and exit code 2.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpcourse import detectors, script_checks
from dpcourse.tools import authoring

ROOT = authoring.ROOT
CORPUS = ROOT / "tests" / "scripts" / "diagnose"

# script -> the findings diagnose must report, no more, no fewer
EXPECTED = {
    "good_torchrun.py": set(),
    "blog_cpu_port.py": {"set_epoch", "save_race", "module_prefix", "barrier", "rank0_loss"},
    "no_sampler.py": {"no_sampler"},
    "eval_with_sampler.py": {"eval_sampler"},
    "seeds_no_broadcast.py": {"replicas", "destroy"},
    "no_init.py": {"no_init"},
    "trainer_peek.py": set(),
    "sampler_per_epoch.py": {"set_epoch", "rank0_loss"},
    "log_every_rank.py": {"log_every_rank"},
    "writer_every_rank.py": {"writer_every_rank"},
    "unused_reduce.py": {"unused_reduce", "rank0_loss"},
}


_RUNS: dict = {}


def run(name: str, *args, cpu: bool = False):
    """One diagnose run per script and setting for the module: several tests read the same
    script's result (blog_cpu_port, unused_reduce, gpu_tutorial), and a run is deterministic."""
    key = (name, args, cpu)
    if key not in _RUNS:
        _RUNS[key] = detectors.diagnose(str(CORPUS / name), 2, *args, timeout=60, cpu=cpu)
    return _RUNS[key]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_script_gets_exactly_its_findings(name):
    result = run(name)
    assert result.status == "ok", result.report()
    found = {f.check for f in result.findings}
    assert found == EXPECTED[name], result.report()
    for f in result.findings:
        assert f.lesson.startswith("lesson "), f
        assert f.where == "the whole script" or f.where == "end of script" or \
            re.fullmatch(rf"{re.escape(name)}:\d+(, called from {re.escape(name)}:\d+)?",
                         f.where), f
    assert result.ok == (not EXPECTED[name])
    text = result.report()
    if EXPECTED[name]:
        assert f"run-time checks: {len(EXPECTED[name])} finding(s), most serious first:" in text
    else:
        assert "run-time checks: nothing found" in text


def test_findings_point_at_the_right_lines():
    result = run("blog_cpu_port.py")
    lines = (CORPUS / "blog_cpu_port.py").read_text().splitlines()
    at = {f.check: lines[int(f.where.split(":")[1]) - 1].strip() for f in result.findings}
    assert at["set_epoch"].startswith("for inputs, labels in loader")
    assert at["barrier"].startswith("dist.barrier()")
    assert at["save_race"].startswith("torch.save(") and at["module_prefix"] == at["save_race"]
    assert at["rank0_loss"].startswith("print(")
    severities = [f.severity for f in result.findings]
    assert severities == sorted(severities)  # most serious first


def test_a_gpu_only_script_is_told_what_to_change_and_runs_with_cpu():
    result = run("gpu_tutorial.py")
    assert result.status == "failed" and "ProcessGroupNCCL" in result.error
    report = result.report()
    assert re.search(r"what to change at gpu_tutorial.py:\d+: the script asks for the NCCL backend",
                     report)
    assert "init_process_group('gloo')" in report and "diagnose --cpu" in report
    assert "the run stopped early" in report  # not "nothing found": the checks did not run
    on_cpu = run("gpu_tutorial.py", cpu=True)
    assert on_cpu.status == "ok" and on_cpu.findings == [], on_cpu.report()


def _line_of(name: str, piece: str) -> int:
    lines = (CORPUS / name).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if piece in line)


def test_a_gpu_only_failure_names_the_learners_line():
    nccl = run("gpu_tutorial.py")
    at = _line_of("gpu_tutorial.py", "init_process_group(")
    assert nccl.error_where == f"gpu_tutorial.py:{at}"
    assert f"what to change at gpu_tutorial.py:{at}: the script asks for the NCCL" in \
        nccl.report()
    # a .to(cuda) inside the script's own helper: the helper's line and the line that called it
    helper = run("gpu_device_helper.py")
    inner = _line_of("gpu_device_helper.py", ".to(device), device")
    outer = _line_of("gpu_device_helper.py", "= build_model(")
    assert helper.status == "failed", helper.report()
    assert (f"what to change at gpu_device_helper.py:{inner}, called from "
            f"gpu_device_helper.py:{outer}: the script moves tensors or the model to CUDA"
            in helper.report()), helper.report()
    on_cpu = run("gpu_device_helper.py", cpu=True)
    assert on_cpu.status == "ok" and on_cpu.findings == [], on_cpu.report()


def test_an_unused_reduction_is_named_at_its_line_and_the_print_still_counts_as_local():
    result = run("unused_reduce.py")
    by = {f.check: f for f in result.findings}
    assert by["unused_reduce"].where == \
        f"unused_reduce.py:{_line_of('unused_reduce.py', 'dist.all_reduce(global_loss)')}"
    assert "nothing reads global_loss afterwards" in by["unused_reduce"].message
    # the all_reduce it never reads does not make rank 0's printed loss a global one
    assert by["rank0_loss"].where.startswith("unused_reduce.py:")


@pytest.mark.parametrize("body, unused", [
    # a new tensor, reduced, never read: reported
    ("t = torch.tensor([loss.item()])\ndist.all_reduce(t)\n", [(2, "t")]),
    ("t = loss.detach().clone() / 2\ndist.all_reduce(t)\n", [(2, "t")]),
    ("def f(loss):\n    t = torch.zeros(2)\n    dist.all_reduce(t, op=dist.ReduceOp.SUM)\n",
     [(3, "t")]),
    # read afterwards, or sharing memory with a tensor that is: never reported
    ("t = torch.tensor([1.0])\ndist.all_reduce(t)\nprint(t.item())\n", []),
    ("t = loss.detach()\ndist.all_reduce(t)\n", []),  # t is loss's memory: loss sees the sum
    ("t = p.grad\ndist.all_reduce(t)\n", []),         # the gradient itself
    ("dist.all_reduce(p.grad)\n", []),                 # not a name
    ("for t in grads:\n    dist.all_reduce(t)\n", []),
    ("def f(t):\n    dist.all_reduce(t)\n", []),       # the caller's tensor
    ("t = torch.zeros(2)\nt += x\ndist.all_reduce(t)\nt2 = t\n", []),
    ("t, n = torch.zeros(1), 0\ndist.all_reduce(t)\nreturn_value = [t]\n", []),
    ("t = torch.zeros(1)\ndist.all_reduce(t)\ndef g():\n    return t\n", []),  # a closure reads it
    ("t = torch.zeros(1)\ndist.all_reduce(t)\nlogs.append(t)\n", []),
])
def test_unused_reductions_reads_only_what_it_can_be_sure_of(body, unused):
    assert script_checks.unused_reductions(body) == unused


def test_a_sampler_beside_shuffle_is_explained():
    result = run("sampler_and_shuffle.py")
    assert result.status == "failed"
    assert "drop the loader's shuffle" in result.report()
    assert not result.findings  # the group it never destroyed is not blamed: it crashed first


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "dpcourse", "diagnose", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _main(capsys, *args):
    """`python -m dpcourse diagnose ARGS` through the same main() in this process: (exit code,
    what it printed). The one subprocess below proves the command line reaches main()."""
    from dpcourse.__main__ import main

    capsys.readouterr()
    code = main(["diagnose", *args])
    return code, capsys.readouterr().out


def test_the_command_line_bad_input_and_json(tmp_path, capsys):
    # the command itself, once: exit code 1 and the JSON report on stdout
    out = _cli("--json", "--timeout", "60", str(CORPUS / "no_sampler.py"))
    report = json.loads(out.stdout)
    assert out.returncode == 1 and report["status"] == "ok" and not report["ok"]
    assert [f["check"] for f in report["findings"]] == ["no_sampler"]
    # the same mistake in lab 10's own bug 2: the findings are withheld (the lab's check judges)
    lab_script = ROOT / "lib" / "dpcourse" / "scripts" / "lab10" / "bug2_loader.py"
    code, text = _main(capsys, "--json", "--timeout", "60", str(lab_script), "--out",
                       str(tmp_path / "final.pt"))
    withheld = json.loads(text)
    assert code == 1 and withheld["findings_withheld"] and withheld["findings"] == []
    # the rest through the same main() in this process (a subprocess each cost an interpreter,
    # torch's import and a cold fork server)
    code, text = _main(capsys, str(tmp_path / "nope.py"))
    assert code == 2 and "is not a file" in text
    broken = tmp_path / "broken.py"
    broken.write_text("for x in range(3)\n    pass\n")
    code, text = _main(capsys, str(broken))
    assert code == 2 and "is not valid Python (line 1" in text
    code, text = _main(capsys, "--timeout", "60", str(CORPUS / "needs_args.py"))
    assert code == 1 and "pass them after the script's name" in text
    if torch.cuda.is_available():  # the script fails only where no GPU is
        return
    code, text = _main(capsys, "--json", "--timeout", "60", str(CORPUS / "gpu_tutorial.py"))
    failed = json.loads(text)
    assert code == 1 and failed["status"] == "failed" and failed["error_where"] == "gpu_tutorial.py:11"


def test_every_lesson_a_finding_names_has_that_section():
    """A finding sends the learner to a lesson section: the section must exist."""
    titles = {}
    for path in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py")):
        titles[path.stem[:2]] = "\n".join(line.replace("`", "") for line in
                                           path.read_text().splitlines()
                                           if line.startswith("# #"))
    texts = [f.lesson for f in _all_findings()] + [lesson for _, _, lesson in
                                                    script_checks._FAILURES]
    for text in texts:
        for part in text.split("; "):
            m = re.fullmatch(r"lesson (\d\d)(?: \(lab\))?(?:, (.*))?", part)
            assert m, part
            number, section = m.groups()
            assert number in titles, part
            if section and not section.startswith(("bug", "bugs", "§")):
                assert section in titles[number], f"{part}: no such section in lesson {number}"
            if section and section.startswith("§"):
                heading = section.split(" ", 1)[0].lstrip("§")
                assert re.search(rf"^# ##+ {re.escape(heading)}\.", titles[number], re.M), part


def _all_findings():
    """One Finding of every kind analyze() can return, from synthetic events."""
    ev = lambda rank, kind, **d: {"kind": kind, "rank": rank, **d}  # noqa: E731
    where = {"where": "x.py:1"}
    train = dict(id=1, epoch=0, shuffle=True, drop_last=False, replicas=2, size=9, grad=True,
                 dataset=7, seed=0)
    events = {r: [ev(r, "init", **where),
                  ev(r, "sampler", seq=1, **train, **where),
                  ev(r, "loader", id=4, sampler="DistributedSampler", size=9, backward=2, seq=1,
                     **where),
                  ev(r, "sampler", seq=2, **train, **where),
                  ev(r, "loader", id=4, sampler="DistributedSampler", size=9, backward=2, seq=2,
                     **where),
                  ev(r, "sampler", id=2, epoch=0, shuffle=False, drop_last=False, replicas=2,
                     size=9, grad=False, dataset=8, seed=0, seq=3, **where),
                  ev(r, "loader", id=3, sampler="RandomSampler", size=9, backward=3, seq=4,
                     **where),
                  ev(r, "save", path="/tmp/x.pt", prefixed=True, **where),
                  ev(r, "first_step", digest=str(r), **where),
                  *[ev(r, "barrier", **where)] * 3,
                  ev(r, "end", initialized=True, steps=3, error=False)] for r in (0, 1)}
    events[0].append(ev(0, "print", **where))
    found = script_checks.analyze(events, 2)
    assert {f.check for f in found} == {"set_epoch", "eval_sampler", "no_sampler",
                                        "module_prefix", "destroy", "save_race", "replicas",
                                        "barrier", "rank0_loss"}
    none = script_checks.analyze({0: [ev(0, "end", initialized=False, steps=1, error=False)],
                                  1: [ev(1, "end", initialized=False, steps=1, error=False)]}, 2)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "x.py")
        script.write_text("t = torch.zeros(1)\ndist.all_reduce(t)\n")
        logged = script_checks.analyze({r: [ev(r, "init", **where), ev(r, "print", **where),
                                            ev(r, "writer", what="a wandb run", **where),
                                            ev(r, "reduce", where="x.py:2"),
                                            ev(r, "end", initialized=False, steps=1,
                                               error=False)] for r in (0, 1)}, 2, str(script))
    assert {f.check for f in logged} == {"log_every_rank", "writer_every_rank",
                                         "unused_reduce"}
    return found + none + logged


def test_analyze_stays_quiet_on_a_clean_run_and_on_a_crash():
    ev = lambda rank, kind, **d: {"kind": kind, "rank": rank, **d}  # noqa: E731
    clean = {r: [ev(r, "init", where="x:1")]
             + [x for e in (0, 1) for x in (
                 # a peek at the loader before set_epoch (no backward while it is read) ...
                 ev(r, "sampler", id=1, epoch=0, shuffle=True, drop_last=False, replicas=2,
                    size=9, grad=True, dataset=7, seed=0, seq=10 * e, where="x:2"),
                 ev(r, "loader", id=4, sampler="DistributedSampler", size=9, backward=0,
                    seq=10 * e, where="x:2"),
                 # ... then the epoch's training read, at its own epoch
                 ev(r, "sampler", id=1, epoch=e, shuffle=True, drop_last=False, replicas=2,
                    size=9, grad=True, dataset=7, seed=0, seq=10 * e + 1, where="x:3"),
                 ev(r, "loader", id=4, sampler="DistributedSampler", size=9, backward=2,
                    seq=10 * e + 1, where="x:3"))]
             for r in (0, 1)}
    for r in (0, 1):
        clean[r] += [ev(r, "first_step", digest="same", where="x:3"),
                     ev(r, "end", initialized=False, steps=4, error=False)]
    assert script_checks.analyze(clean, 2) == []
    crashed = {r: [ev(r, "init", where="x:1"), ev(r, "end", initialized=True, steps=0,
                                                  error=True)] for r in (0, 1)}
    assert script_checks.analyze(crashed, 2) == []
