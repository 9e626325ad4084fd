"""python -m dpcourse workshop-check: the per-learner settings, the rehearsal with 4 learners on
this CPU, and each of its alarms (clash, orphan, bound port, failed launch) made to go off."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpcourse.tools import workshop

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("learners, gpus, cpus, expected", [
    # no GPU: everyone on the cpu profile, CUDA hidden, cores split over 4 x 2 ranks
    (4, 0, 16, [("", "cpu", "2")] * 4),
    # 8 GPUs, 4 learners: two GPUs each, contiguous, NCCL profile
    (4, 8, 64, [("0,1", "multi-gpu", "8"), ("2,3", "multi-gpu", "8"),
                ("4,5", "multi-gpu", "8"), ("6,7", "multi-gpu", "8")]),
    # as many GPUs as learners: one each
    (2, 2, 8, [("0", "one-gpu", "2"), ("1", "one-gpu", "2")]),
    # fewer GPUs than learners: everyone on the CPU, the same course for all
    (3, 2, 2, [("", "cpu", "1")] * 3),
])
def test_learner_settings(learners, gpus, cpus, expected):
    settings = workshop.learner_settings(learners, gpus, cpus)
    got = [(s.env["CUDA_VISIBLE_DEVICES"], s.env["DPCOURSE_PROFILE"], s.env["OMP_NUM_THREADS"])
           for s in settings]
    assert got == expected
    assert [s.learner for s in settings] == list(range(learners))
    assert all(set(s.env) == {"CUDA_VISIBLE_DEVICES", "DPCOURSE_PROFILE", "OMP_NUM_THREADS"}
               for s in settings)


def test_leftover_gpus_are_named_and_settings_paste_as_exports():
    settings = workshop.learner_settings(4, 6, 24)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in settings] == ["0", "1", "2", "3"]
    assert "2 GPU(s) left" in settings[-1].note
    text = workshop.format_settings(settings)
    assert "learner 0: export CUDA_VISIBLE_DEVICES=0 DPCOURSE_PROFILE=one-gpu" in text
    assert "MASTER_PORT stays unset" in text
    cpu = workshop.format_settings(workshop.learner_settings(1, 0, 2))
    assert "CUDA_VISIBLE_DEVICES='' " in cpu  # an empty value, quoted so the shell keeps it


@pytest.mark.parametrize("kwargs", [dict(learners=0, gpu_count=0, cpu_count=2),
                                    dict(learners=2, gpu_count=0, cpu_count=2, ranks=0)])
def test_bad_settings_input(kwargs):
    with pytest.raises(ValueError, match="must be at least 1"):
        workshop.learner_settings(**kwargs)


def test_four_learners_at_once_on_this_cpu(no_leftovers):
    # The rehearsal the issue asks for: N = 4 on the CPU (about 25-45 s on 2 cores).
    report = workshop.workshop_check(4, ranks=2, timeout=150, gpu_count=0)
    assert report.ok, workshop.format_report(report)
    assert [r["learner"] for r in report.records] == [0, 1, 2, 3]
    ports = [p for r in report.records for p in r["ports"]]
    assert len(ports) == 8 and len(set(ports)) == 8  # a spawn and a torchrun per learner
    assert report.orphans == [] and report.bound_ports == []
    for r in report.records:
        assert 0 < r["spawn_s"] < r["total_s"] and 0 < r["torchrun_s"] < r["total_s"]
    text = workshop.format_report(report)
    assert "no port clash: 8 launches on 8 different ports" in text
    assert text.rstrip().endswith("workshop check passed")


def test_a_launch_that_times_out_fails_the_check_and_leaves_nothing(no_leftovers):
    # 0.5 s is too short for two ranks to even import torch: every learner's launch times
    # out, the check says so per learner, and still nothing is left running.
    report = workshop.workshop_check(2, ranks=2, timeout=0.5, gpu_count=0)
    assert not report.ok
    assert all(not r["ok"] and "LaunchTimeoutError" in r["error"] for r in report.records)
    assert report.orphans == []
    assert "FAILED: LaunchTimeoutError" in workshop.format_report(report)
    assert workshop.format_report(report).rstrip().endswith("workshop check FAILED")


def test_the_alarms_go_off():
    # a port used by two launches
    records = [{"ports": [5000, 5001]}, {"ports": [5002, 5000]}]
    assert workshop.duplicate_ports(records) == [5000]
    assert workshop.duplicate_ports([{"ports": [1, 2]}, {"ports": [3]}]) == []
    # an orphan: a process carrying the run's tag, found even though it is not our child's child
    env = dict(os.environ, **{workshop.TAG: "abc123-0"})
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while not workshop.tagged_processes("abc123") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [line.split()[0] for line in workshop.tagged_processes("abc123")] == [str(orphan.pid)]
        assert workshop.tagged_processes("zzz999") == []
    finally:
        orphan.kill()
        orphan.wait()
    # a port still bound
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert workshop.port_is_bound(port)
    assert not workshop.port_is_bound(port)


@pytest.mark.parametrize("args, message", [
    (["--learners", "0"], "--learners must be at least 1"),
    (["--learners", "2", "--ranks", "0"], "--ranks must be at least 1"),
    (["--learners", "2", "--timeout", "0"], "--timeout must be a positive number"),
])
def test_cli_bad_input_is_one_line(args, message):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    proc = subprocess.run([sys.executable, "-m", "dpcourse", "workshop-check", *args],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_cli_plan_prints_settings_and_runs_nothing():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    proc = subprocess.run([sys.executable, "-m", "dpcourse", "workshop-check", "--learners",
                           "3", "--plan"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("export ") == 3 and "OMP_NUM_THREADS=" in proc.stdout
