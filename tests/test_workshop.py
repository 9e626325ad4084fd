"""python -m dpcourse workshop-check: the plan (seats of GPUs, cores, threads and memory, for a
server one is not on), its three printed forms (the JupyterHub one loaded as a hub config), the
hub's side (seats kept across restarts, a learner's copy never overwritten), the rehearsal with
3 learners running what lessons 03, 04, 06 and lab03 run, and each of its alarms (clash, orphan,
bound port, failed launch, oversubscription) made to go off; each learner's edition (English or
Chinese: the class's, or their own from editions.json) and a bad one refused in one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from traitlets.config.loader import PyFileConfigLoader

from dpcourse.tools import workshop

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))


def _seats(settings):
    return [(s.env["CUDA_VISIBLE_DEVICES"], s.env["DPCOURSE_PROFILE"], s.env["OMP_NUM_THREADS"],
             s.cpus) for s in settings]


def test_plan_8_gpus_64_cores_20_learners():
    settings = workshop.learner_settings(20, 8, 64, memory_gib=512)
    seats = _seats(settings)
    # the 8 GPUs in 4 seats of 2 (NCCL), the other 16 learners on the CPU profile
    assert seats[:4] == [("0,1", "multi-gpu", "1", "0-2"), ("2,3", "multi-gpu", "1", "3-5"),
                         ("4,5", "multi-gpu", "1", "6-8"), ("6,7", "multi-gpu", "1", "9-11")]
    assert all(s[:3] == ("", "cpu", "1") for s in seats[4:])
    # 3 cores each, pinned, disjoint; 4 left for the hub; 512 GiB x 0.9 / 20 = 23 GiB each
    cores = [workshop.parse_cpus(s.cpus) for s in settings]
    assert all(len(c) == 3 for c in cores) and len(set().union(*cores)) == 60
    assert max(set().union(*cores)) == 59 and "4 core(s) left" in settings[-1].note
    assert {s.mem_gib for s in settings} == {23.0} and {s.cores for s in settings} == {3}
    text = "\n".join(workshop.summary(settings, 8, 64, 512))
    assert "learners 0-3: 2 GPU(s) each, profile multi-gpu" in text
    assert "learners 4-19: no GPU, profile cpu" in text
    assert "3 core(s) of their own (pinned), OMP_NUM_THREADS=1, 23 GiB" in text
    assert "lesson 06's fit starts 4 ranks: on 3 core(s) they take turns" in text


def test_plan_without_gpus_and_with_many_per_learner():
    # no GPU: everyone on the cpu profile, CUDA hidden; 16 cores / 4 learners = 4 each, and
    # 4 / 4 ranks (lesson 06's fit) = 1 thread per rank
    assert _seats(workshop.learner_settings(4, 0, 16)) == [
        ("", "cpu", "1", "0-3"), ("", "cpu", "1", "4-7"), ("", "cpu", "1", "8-11"),
        ("", "cpu", "1", "12-15")]
    # 16 GPUs, 64 cores, 4 learners: 4 GPUs and 16 cores each, 16 / 4 = 4 threads per rank
    assert _seats(workshop.learner_settings(4, 16, 64)) == [
        ("0,1,2,3", "multi-gpu", "4", "0-15"), ("4,5,6,7", "multi-gpu", "4", "16-31"),
        ("8,9,10,11", "multi-gpu", "4", "32-47"), ("12,13,14,15", "multi-gpu", "4", "48-63")]
    # fewer cores than learners: they share all of them, one thread per rank
    shared = workshop.learner_settings(3, 0, 2)
    assert _seats(shared) == [("", "cpu", "1", "")] * 3
    assert "shares the 2 cores with 2 other learner(s)" in shared[0].note


def test_plan_3_gpus_5_learners():
    settings = workshop.learner_settings(5, 3, 16, memory_gib=64)
    assert _seats(settings) == [("0,1", "multi-gpu", "1", "0-2"), ("2", "one-gpu", "1", "3-5"),
                                ("", "cpu", "1", "6-8"), ("", "cpu", "1", "9-11"),
                                ("", "cpu", "1", "12-14")]
    assert "1 core(s) left" in settings[-1].note and settings[0].mem_gib == 11.5
    text = workshop.format_settings(settings)
    assert ("learner 1: export CUDA_VISIBLE_DEVICES=2 DPCOURSE_PROFILE=one-gpu "
            "OMP_NUM_THREADS=1   # 1 GPU") in text
    assert "learner 2: export CUDA_VISIBLE_DEVICES='' " in text  # empty, quoted for the shell
    assert "taskset -c 6-8" in text and "MASTER_PORT stays unset" in text


@pytest.mark.parametrize("kwargs, message", [
    (dict(learners=0, gpu_count=0, cpu_count=2), "--learners must be at least 1"),
    (dict(learners=2, gpu_count=0, cpu_count=2, ranks=0), "--ranks must be at least 1"),
    (dict(learners=2, gpu_count=-1, cpu_count=2), "--gpus must be 0 or more"),
    (dict(learners=2, gpu_count=0, cpu_count=0), "--cores must be at least 1"),
    (dict(learners=2, gpu_count=0, cpu_count=2, memory_gib=0), "--memory must be a positive"),
])
def test_bad_plan_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        workshop.learner_settings(**kwargs)


def _load_hub_config(path: Path):
    return PyFileConfigLoader(path.name, path=str(path.parent)).load_config()


class FakeSpawner(SimpleNamespace):
    """What the pre-spawn hook touches on a JupyterHub spawner."""

    def __init__(self, name: str, home: Path):
        super().__init__(user=SimpleNamespace(name=name), environment={"KEEP": "1"},
                         cmd=[sys.executable, "-m", "jupyterhub.singleuser"], home_dir=str(home),
                         log=SimpleNamespace(info=lambda *a: None), notebook_dir="",
                         cpu_limit=None, mem_limit=None)


def test_the_jupyterhub_form_loads_in_a_hub_config(tmp_path, monkeypatch):
    monkeypatch.delenv("DPCOURSE_EDITION", raising=False)  # the class's edition: English
    text = workshop.format_jupyterhub(8, 64, 20, 512)
    assert "#   seat 0: CUDA_VISIBLE_DEVICES=0,1 DPCOURSE_PROFILE=multi-gpu" in text
    path = tmp_path / "jupyterhub_config.py"
    path.write_text(text)
    monkeypatch.chdir(tmp_path)  # the form keeps seats.json where the hub starts
    c = _load_hub_config(path)
    assert c.Spawner.default_url == "/lab/tree/lessons/00_start_here.ipynb"
    assert c.Spawner.cmd == [sys.executable, "-m", "jupyterhub.singleuser"]
    assert c.Spawner.cpu_limit == 3.0 and c.Spawner.mem_limit == f"{23 * 1024}M"
    hook = c.Spawner.pre_spawn_hook
    alice, bob = FakeSpawner("alice", tmp_path / "alice"), FakeSpawner("bob", tmp_path / "bob")
    hook(alice)
    hook(bob)
    assert alice.environment == {"KEEP": "1", "CUDA_VISIBLE_DEVICES": "0,1",
                                 "DPCOURSE_PROFILE": "multi-gpu", "OMP_NUM_THREADS": "1",
                                 "DPCOURSE_SEAT": "0", "DPCOURSE_EDITION": "en",
                                 "DPCOURSE_PROGRESS": str(tmp_path / "progress.jsonl")}
    assert alice.default_url == "/lab/tree/lessons/00_start_here.ipynb"
    assert bob.environment["CUDA_VISIBLE_DEVICES"] == "2,3" and bob.environment["DPCOURSE_SEAT"] == "1"
    if alice.cmd[0].endswith("taskset"):  # pinned to the seat's cores where taskset exists
        assert alice.cmd[1:3] == ["-c", "0-2"] and bob.cmd[1:3] == ["-c", "3-5"]
    assert alice.notebook_dir == str(tmp_path / "alice" / "dpcourse")
    assert (tmp_path / "alice" / "dpcourse" / "lessons" / "00_start_here.ipynb").is_file()
    assert json.loads((tmp_path / "seats.json").read_text()) == {"alice": 0, "bob": 1}


def test_seats_are_kept_and_a_learners_copy_never_overwritten(tmp_path):
    seats = workshop.learner_settings(3, 0, 6)
    book = workshop.SeatBook(tmp_path / "seats.json", seats)
    assert [book.seat_for(n).learner for n in ("carol", "dave", "carol")] == [0, 1, 0]
    again = workshop.SeatBook(tmp_path / "seats.json", seats)  # the hub restarted
    assert again.seat_for("dave").learner == 1 and again.seat_for("erin").learner == 2
    with pytest.raises(RuntimeError, match="all 3 seats are taken"):
        again.seat_for("frank")
    # the copy: made once, the learner's edits kept, a deleted file restored
    dest = tmp_path / "home" / "dpcourse"
    first = workshop.copy_course(dest)
    assert first > 50 and (dest / "labs" / "lab03_ddp_first_principles.ipynb").is_file()
    lab = dest / "labs" / "lab03_ddp_first_principles.ipynb"
    lab.write_text("my work")
    (dest / "README.md").unlink()
    assert workshop.copy_course(dest) == 1
    assert lab.read_text() == "my work" and (dest / "README.md").is_file()
    assert not list(dest.rglob("__pycache__")) and not list(dest.rglob(".ipynb_checkpoints"))


def test_the_classroom_config_loads(tmp_path, monkeypatch):
    monkeypatch.delenv("DPCOURSE_EDITION", raising=False)
    monkeypatch.setenv("DPCOURSE_LEARNERS", "3")
    monkeypatch.setenv("DPCOURSE_CLASSROOM_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("DPCOURSE_HUB_SPAWNER", "simple")
    c = _load_hub_config(ROOT / "classroom" / "jupyterhub_config.py")
    assert c.Authenticator.allowed_users == {"learner01", "learner02", "learner03"}
    assert c.JupyterHub.authenticator_class == "dummy" and c.JupyterHub.spawner_class == "simple"
    assert c.JupyterHub.bind_url == "http://127.0.0.1:8000"  # this machine only, by default
    assert c.SimpleLocalProcessSpawner.home_dir_template == str(tmp_path / "state" / "home"
                                                                / "{username}")
    assert callable(c.Spawner.pre_spawn_hook) and c.JupyterHub.cleanup_servers is True
    assert c.Spawner.default_url == "/lab/tree/lessons/00_start_here.ipynb"  # English by default
    monkeypatch.setenv("DPCOURSE_HUB_SPAWNER", "kubernetes")
    with pytest.raises(ValueError, match="use simple, local or systemd"):
        _load_hub_config(ROOT / "classroom" / "jupyterhub_config.py")


def test_the_class_edition_and_a_learners_own(tmp_path, monkeypatch):
    # the class's edition: DPCOURSE_EDITION, English where unset or empty
    assert workshop.class_edition({}) == "en" and workshop.class_edition({"DPCOURSE_EDITION": ""}) == "en"
    assert workshop.class_edition({"DPCOURSE_EDITION": "zh"}) == "zh"
    with pytest.raises(ValueError, match=r"^DPCOURSE_EDITION is 'cn': use en or zh$"):
        workshop.class_edition({"DPCOURSE_EDITION": "cn"})
    # a learner's own, from the file an instructor writes; read again at every start
    path = tmp_path / "editions.json"
    book = workshop.EditionBook(path, "en")
    assert book.edition_for("learner01") == "en"  # no file: the class's
    path.write_text('{"learner02": "zh"}')
    assert [book.edition_for(n) for n in ("learner01", "learner02")] == ["en", "zh"]
    assert workshop.EditionBook(path, "zh").edition_for("learner01") == "zh"
    path.write_text('{"learner02": "en"}')  # edited while the hub runs
    assert book.edition_for("learner02") == "en"
    # a bad file: one line, naming the file (and the learner) and the allowed values
    for text, message in [('{"learner02": "Chinese"}', f"{path}: learner02's edition is "
                           "'Chinese': use en or zh"),
                          ('{"learner02": ["zh"]}', f"{path}: learner02's edition is ['zh']"),
                          ('["learner02"]', f'{path} should hold {{learner: "en" or "zh"}}, '
                           "got list"),
                          ('{"learner02": zh}', f"{path} is not JSON (Expecting value: line 1 "
                           "column 15 (char 14))")]:
        path.write_text(text)
        with pytest.raises(ValueError) as err:
            book.edition_for("learner01")
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=r"^the class's edition is 'fr': use en or zh$"):
        workshop.EditionBook(path, "fr")
    assert workshop.edition_url("zh") == "/lab/tree/zh/lessons/00_start_here.ipynb"
    assert workshop.edition_url("en") == workshop.DEFAULT_URL


def test_a_zh_learner_opens_the_chinese_lesson_00_with_zh_copied(tmp_path, monkeypatch):
    # the classroom's config, an English class with one Chinese learner (bob), as the hub runs
    # the hook at each server start
    state = tmp_path / "state"
    state.mkdir()
    (state / "editions.json").write_text('{"bob": "zh"}')
    monkeypatch.delenv("DPCOURSE_EDITION", raising=False)
    monkeypatch.setenv("DPCOURSE_LEARNERS", "3")
    monkeypatch.setenv("DPCOURSE_CLASSROOM_STATE", str(state))
    monkeypatch.setenv("DPCOURSE_HUB_SPAWNER", "simple")
    c = _load_hub_config(ROOT / "classroom" / "jupyterhub_config.py")
    alice, bob = FakeSpawner("alice", tmp_path / "alice"), FakeSpawner("bob", tmp_path / "bob")
    c.Spawner.pre_spawn_hook(alice)
    c.Spawner.pre_spawn_hook(bob)
    assert (alice.environment["DPCOURSE_EDITION"], alice.default_url) == (
        "en", "/lab/tree/lessons/00_start_here.ipynb")
    assert (bob.environment["DPCOURSE_EDITION"], bob.default_url) == (
        "zh", "/lab/tree/zh/lessons/00_start_here.ipynb")
    assert bob.environment["DPCOURSE_SEAT"] == "1" and bob.environment["KEEP"] == "1"
    # both editions in every learner's copy: the page a zh learner opens is there, as are the
    # Chinese labs beside the English ones, and the English course is still whole
    for name in ("alice", "bob"):
        copy = tmp_path / name / "dpcourse"
        for part in ("zh/lessons/00_start_here.ipynb", "zh/labs/lab03_ddp_first_principles.ipynb",
                     "zh/solutions/lab03_ddp_first_principles.ipynb",
                     "lessons/00_start_here.ipynb", "labs/lab03_ddp_first_principles.ipynb"):
            assert (copy / part).is_file(), (name, part)
        assert len(list((copy / "zh" / "labs").glob("*.ipynb"))) == len(
            list((ROOT / "zh" / "labs").glob("*.ipynb")))
    assert "zh" in workshop.COURSE_PARTS
    # a Chinese class: the default page is the Chinese lesson 00
    monkeypatch.setenv("DPCOURSE_EDITION", "zh")
    (state / "editions.json").unlink()
    c = _load_hub_config(ROOT / "classroom" / "jupyterhub_config.py")
    assert c.Spawner.default_url == "/lab/tree/zh/lessons/00_start_here.ipynb"
    carol = FakeSpawner("carol", tmp_path / "carol")
    c.Spawner.pre_spawn_hook(carol)
    assert carol.environment["DPCOURSE_EDITION"] == "zh"
    assert carol.default_url == "/lab/tree/zh/lessons/00_start_here.ipynb"


def test_a_bad_edition_stops_the_hub_in_one_line(tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("DPCOURSE_LEARNERS", "3")
    monkeypatch.setenv("DPCOURSE_CLASSROOM_STATE", str(state))
    monkeypatch.setenv("DPCOURSE_HUB_SPAWNER", "simple")
    monkeypatch.setenv("DPCOURSE_EDITION", "chinese")
    with pytest.raises(ValueError, match=r"^DPCOURSE_EDITION is 'chinese': use en or zh$"):
        _load_hub_config(ROOT / "classroom" / "jupyterhub_config.py")
    monkeypatch.setenv("DPCOURSE_EDITION", "en")
    state.mkdir(exist_ok=True)  # the config made it before it refused the variable
    (state / "editions.json").write_text('{"learner02": "ZH"}')
    message = f"{state / 'editions.json'}: learner02's edition is 'ZH': use en or zh"
    with pytest.raises(ValueError) as err:  # at the hub's start, before anyone logs in
        _load_hub_config(ROOT / "classroom" / "jupyterhub_config.py")
    assert str(err.value) == message
    # written while the hub runs: that learner's spawn fails with the same line
    (state / "editions.json").write_text("{}")
    c = _load_hub_config(ROOT / "classroom" / "jupyterhub_config.py")
    (state / "editions.json").write_text('{"learner02": "ZH"}')
    with pytest.raises(ValueError) as err:
        c.Spawner.pre_spawn_hook(FakeSpawner("learner02", tmp_path / "learner02"))
    assert str(err.value) == message


def test_three_learners_at_once_on_this_cpu(no_leftovers):
    # The rehearsal: 3 learners, each running lessons 03, lab03, 04 and 06 (about 50-70 s on
    # 2 cores, lesson 04's torchrun job being most of it).
    report = workshop.workshop_check(3, timeout=150, gpu_count=0)
    text = workshop.format_report(report)
    assert report.ok, text
    assert [r["learner"] for r in report.records] == [0, 1, 2]
    ports = [p for r in report.records for p in r["ports"]]
    assert len(ports) == 9 and len(set(ports)) == 9  # lessons 03, 04 and 06 per learner
    for r in report.records:
        assert [x["step"][:9] for x in r["launches"]] == ["lesson 03", "lab03's c", "lesson 04",
                                                          "lesson 06"]
        measured = [x for x in r["launches"] if "threads" in x]
        assert [x["ranks"] for x in measured] == [2, 4] and all(x["threads"] == 1 for x in measured)
        assert r["kernel_threads"] == 1
    assert "no port clash: 9 launches on 9 different ports" in text
    assert "no launch oversubscribed by threads" in text
    assert "lesson 06's alpha-beta fit (4 ranks" in text  # the note: 4 ranks on fewer cores
    assert text.rstrip().endswith("workshop check passed")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores: 1 for the seat, 1 more "
                    "for torch to take")
def test_an_oversubscribed_plan_is_refused(no_leftovers):
    # A 1-core seat (the learner pinned to core 0) with OMP_NUM_THREADS=4: torch in the
    # learner's kernel starts 2 threads (it caps the variable at the machine's 2 cores, not at
    # the seat's 1), and the check says so and fails. Its ranks take one thread each (setup_rank).
    report = workshop.workshop_check(1, timeout=120, gpu_count=0, cpu_count=1, threads=4,
                                     steps=("03",))
    text = workshop.format_report(report)
    assert not report.ok and all(r["ok"] for r in report.records), text
    threads = min(4, os.cpu_count())
    assert report.oversubscribed == [f"learner 0 (1 core(s) of 1): the kernel runs {threads} "
                                     "threads on 1 core(s) — OMP_NUM_THREADS=4 is more than the "
                                     "learner's cores."]
    assert report.records[0]["launches"][0]["threads"] == 1
    assert "OVERSUBSCRIBED: learner 0" in text and text.rstrip().endswith("FAILED")


def test_ranks_times_threads_above_the_cores_is_named():
    # What the old rank_device did on a 64-core server (32 threads per rank for every learner),
    # as the ranks would report it: refused, with the numbers; one thread per rank is a note.
    seats = workshop.learner_settings(20, 8, 64)
    step = "lesson 03's DDP launch (ddp.ddp_worker)"
    records = [{"learner": i, "kernel_threads": 1, "launches": [
        {"step": step, "ranks": 2, "threads": 32 if i == 5 else 1},
        {"step": "lesson 06's fit", "ranks": 4, "threads": 1}]} for i in range(20)]
    failures, notes = workshop.oversubscription(records, seats, 64)
    assert failures == [f"learner 5 (3 core(s) of 64), {step}: 2 ranks × 32 threads = 64 threads "
                        "on 3 core(s) — oversubscribed; each rank should run at most 1 "
                        "(OMP_NUM_THREADS=1 in the plan)."]
    assert notes[0].startswith("lesson 06's fit: 4 ranks take turns on a learner's 3 core(s)")
    assert notes[-1] == ("at the peak, 20 learners × 64 busy threads = 1280 on 64 core(s) — if "
                         "they all launch at the same moment")


def test_a_launch_that_times_out_fails_the_check_and_leaves_nothing(no_leftovers):
    # 0.01 s is too short for any launch: lesson 04's torchrun is a new interpreter that imports
    # torch before its agent starts a worker. The learner's launch times out, the check says so
    # in that learner's record, and still nothing is left running. Lesson 04's step, not lesson
    # 03's: the record and the report go through the same run_learner and format_report for
    # either launch, and this one needs no fork server (a learner's first spawn starts one and
    # preloads torch and torch._dynamo into it, about 10 s of this test at load 4 before the
    # 0.01 s even began). A spawn timing out kills every rank (test_launch's
    # test_a_hang_ends_at_the_timeout_naming_the_stuck_ranks, no process left), and a learner's
    # fork server ends with the learner (the rehearsal's "no orphan"). One learner: a record
    # per learner, side by side, is the rehearsal's (test_three_learners_at_once_...).
    report = workshop.workshop_check(1, timeout=0.01, gpu_count=0, steps=("04",))
    assert not report.ok and len(report.records) == 1
    assert all(not r["ok"] and "LaunchTimeoutError" in r["error"] for r in report.records), \
        [r["error"] for r in report.records]
    assert "torchrun did not finish within 0.01 s" in report.records[0]["error"]
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
    (["--plan", "--gpus", "-1"], "--gpus must be 0 or more"),
    (["--plan", "--cores", "0"], "--cores must be at least 1"),
    (["--learners", "2", "--format", "jupyterhub"], "go with --plan"),
])
def test_cli_bad_input_is_one_line(args, message, capsys):
    # through `python -m dpcourse`'s main() in this process (test_cli_plan_in_its_three_forms
    # runs the real command line): the parser's error is SystemExit(2) with one line on stderr;
    # anything else (a traceback) would escape pytest.raises as another exception
    from dpcourse.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["workshop-check", *args])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert message in err and "Traceback" not in err


def test_cli_plan_in_its_three_forms(capsys):
    from dpcourse.__main__ import main

    args = ["workshop-check", "--plan", "--gpus", "8", "--cores", "64", "--learners", "20"]
    # the command line itself, once: `python -m dpcourse workshop-check --plan ...`
    proc = subprocess.run([sys.executable, "-m", "dpcourse", *args], capture_output=True,
                          text=True, env=ENV, timeout=60)
    assert proc.returncode == 0, proc.stderr
    exports = proc.stdout

    def plan(*extra):  # the same main() in this process (a subprocess each cost ~0.5 s)
        capsys.readouterr()
        assert main([*args, *extra]) == 0
        return capsys.readouterr().out

    assert exports.count("export ") == 20 and "memory unknown" in exports  # not this machine's
    assert exports.startswith("20 learners on 8 GPU(s), 64 core(s)")
    assert plan() == exports  # in-process and the command line print the same plan
    data = json.loads(plan("--format", "json", "--memory", "512"))
    assert data["memory_gib"] == 512 and len(data["seats"]) == 20
    assert data["seats"][3]["env"]["CUDA_VISIBLE_DEVICES"] == "6,7"
    hub = plan("--format", "jupyterhub")
    assert "workshop.configure_hub(c, learners=20, gpus=8, cores=64, memory_gib=None" in hub
