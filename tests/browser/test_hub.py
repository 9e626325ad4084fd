"""The classroom, rehearsed for real: classroom/jupyterhub_config.py started as a real JupyterHub
on 127.0.0.1 (free ports, its proxy from npm, the rehearsal spawner, 3 learners), and two of them
using it at the same time in headless Chromium.

What it proves, in the order a class meets it:

1. two learners log in through the hub's login page (DummyAuthenticator) and each gets a
   server of their own, which opens lesson 00 in JupyterLab;
2. each server has its learner's seat from the plan (``dpcourse.tools.workshop``) in its
   environment (``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``, ``DPCOURSE_PROFILE``, the seat,
   the class's progress file), the course's Python as its kernel, and its own copy of the course;
3. both run lesson 03's in-notebook DDP launch (``launch.spawn(ddp.ddp_worker, ...)`` against
   ``ddp.single_process``) at the same time, from JupyterLab's Run menu;
4. one of them runs lab03's first check, which lands in the class's progress file, and
   ``python -m dpcourse progress`` prints the class table from it;
5. stopping the hub leaves no process (hub, proxy, servers, kernels, ranks) and no bound port.

And, on a hub of its own: a learner whom the instructor set to the Chinese edition
(``editions.json``, written while the hub runs) lands on the Chinese lesson 00, with
``DPCOURSE_EDITION=zh`` in their server's environment and zh/ in their copy.

Needs JupyterHub (classroom/requirements.txt) and configurable-http-proxy (npm ci --prefix
classroom), both in README's browser block; without one of them the test is skipped with that
reason, and fails on CI. Every wait is bounded by what it waits for.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from dpcourse import launch
from dpcourse.tools import workshop
from helpers import (ARTIFACTS, ROOT, run_menu, save, saved_errors, wait_for_kernel,
                     wait_until_done)

CONFIG = ROOT / "classroom" / "jupyterhub_config.py"
LEARNERS = 3
PASSWORD = "rehearsal"  # DummyAuthenticator takes any password
NOTEBOOK = "hub_rehearsal.ipynb"
# The learners' own JupyterLab settings (their home is under the hub's state folder): every cell
# in the DOM, and no news toast over the page (as tests/browser/conftest.py does for one server).
USER_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}

ENV_CELL = """\
import json, os, sys
import torch
keys = ["JUPYTERHUB_USER", "DPCOURSE_SEAT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
        "DPCOURSE_PROFILE", "DPCOURSE_PROGRESS", "DPCOURSE_EDITION"]
seen = {k: os.environ.get(k) for k in keys}
seen.update(cwd=os.getcwd(), python=sys.executable, threads=torch.get_num_threads())
print("ENV " + json.dumps(seen))
"""

# What lesson 03's launch cell does (its parameters: global batch 32, 10 steps, lr 0.05,
# width 8, seed 0; world size and backend from the hardware profile).
LAUNCH_CELL = """\
from dpcourse import ddp, devices, launch
from dpcourse.checks import claim

profile = devices.choose_profile()
world_size = profile.world_size
backend = devices.backend_for(world_size)
cfg = ddp.StepConfig(global_batch=32, steps=10, lr=0.05, width=8, seed=0)
wrapped = launch.spawn(ddp.ddp_worker, world_size, cfg, backend=backend, timeout=120)
single = ddp.single_process(cfg)
diff = max(float((r["params"] - single["params"]).abs().max()) for r in wrapped)
claim(f"weights after {cfg.steps} steps: DDP == one process (to 1e-5)", diff < 1e-5)
print(f"LAUNCH {world_size} ranks over {backend}, largest difference {diff:.1e}")
"""

# Lab 03's first TODO, answered, and its check (as the lab notebook has them).
LAB_CELL = """\
import torch
import torch.distributed as dist
from dpcourse.checks import lab03

def average_gradients(model):
    world_size = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    used = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(used)
    for p, n in zip(params, used.tolist()):
        if n == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size

lab03.check_average_gradients(average_gradients)
"""


def _require(what: str, found: bool, fix: str) -> None:
    if found:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing on CI: README's browser block should have installed it")
    pytest.skip(f"{what} is not installed: {fix}")


def _proxy() -> str | None:
    local = ROOT / "classroom" / "node_modules" / ".bin" / "configurable-http-proxy"
    return str(local) if local.exists() else shutil.which("configurable-http-proxy")


def _get(url: str, limit: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=limit) as reply:
            return reply.status
    except OSError:
        return 0


class Hub:
    def __init__(self, url: str, state: Path, proc: subprocess.Popen, ports: list[int], log):
        self.url, self.state, self.proc, self.ports, self.log = url, state, proc, ports, log

    def home(self, name: str) -> Path:
        return self.state / "home" / name


class LearnerServer:
    """A learner's server as tests/browser/helpers.py sees one: its sessions are listed through
    the learner's page (the server's API takes the hub login the page holds)."""

    def __init__(self, page, hub: Hub, name: str):
        self.page, self.hub, self.name = page, hub, name

    def sessions(self) -> list:
        # with the token JupyterLab itself sends (a cookie alone is refused: 403)
        return self.page.evaluate("""async (u) => {
            const cfg = JSON.parse(document.getElementById('jupyter-config-data').textContent);
            const r = await fetch(u, {headers: {Authorization: 'token ' + cfg.token}});
            return r.ok ? await r.json() : [];
        }""", f"/user/{self.name}/api/sessions")

    def url(self, path: str) -> str:
        return f"{self.hub.url}/user/{self.name}/lab/workspaces/test/tree/{path}?reset"


def _descendants(pid: int) -> dict[int, str]:
    import psutil

    try:
        return {p.pid: " ".join(p.cmdline())[:120]
                for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {}


def _listening(pids) -> set[int]:
    import psutil

    ports = set()
    for pid in pids:
        try:
            for conn in psutil.Process(pid).net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    ports.add(conn.laddr.port)
        except psutil.Error:
            continue
    return ports


def _ours(state: Path) -> list[str]:
    """Processes still alive that belong to this hub: started with its state folder in their
    command line or as their home (the hub, the proxy, the servers, their kernels and ranks)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            text = " ".join(p.info["cmdline"] or [])
            if str(state) in text or p.environ().get("HOME", "").startswith(str(state)):
                found.append(f"{p.pid} {text[:120]}")
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture
def hub(tmp_path):
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        jupyterhub = None
    _require("JupyterHub", jupyterhub is not None, "pip install -r classroom/requirements.txt")
    _require("configurable-http-proxy", _proxy() is not None, "npm ci --prefix classroom")
    state = tmp_path / "state"
    ports = [launch.free_port() for _ in range(3)]
    while len(set(ports)) < 3:
        ports = [launch.free_port() for _ in range(3)]
    url = f"http://127.0.0.1:{ports[0]}"
    env = dict(os.environ, DPCOURSE_LEARNERS=str(LEARNERS), DPCOURSE_CLASSROOM_STATE=str(state),
               DPCOURSE_HUB_SPAWNER="simple")
    for name in ("DPCOURSE_PROGRESS", "DPCOURSE_PROFILE", "OMP_NUM_THREADS", "MASTER_PORT",
                 "DPCOURSE_EDITION"):
        env.pop(name, None)  # only the hub gives these out
    if not (ROOT / "classroom" / "node_modules").exists():
        env["PATH"] = os.pathsep.join([str(Path(_proxy()).parent), env.get("PATH", "")])
    cmd = [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG),
           f"--JupyterHub.bind_url={url}",
           f"--JupyterHub.hub_bind_url=http://127.0.0.1:{ports[1]}",
           f"--ConfigurableHTTPProxy.api_url=http://127.0.0.1:{ports[2]}"]
    log_path = ARTIFACTS / "hub.log"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                            start_new_session=True)
    the_hub = Hub(url, state, proc, ports, log_path)
    try:
        deadline = time.monotonic() + 120  # the hub and its proxy answering (a loaded machine: 20 s+)
        while _get(f"{url}/hub/api") != 200:
            if proc.poll() is not None:
                pytest.fail(f"jupyterhub exited with {proc.returncode}:\n"
                            f"{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the hub did not answer within 120 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield the_hub
    finally:
        if proc.poll() is None:  # a test that failed early: stop it all the same
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launch.kill_tree(proc.pid)
        for line in _ours(state):
            launch.kill_tree(int(line.split()[0]))
        log.close()


def _write_settings(home: Path) -> None:
    for name, values in USER_SETTINGS.items():
        path = home / ".jupyter" / "lab" / "user-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _login(page, hub: Hub, name: str) -> None:
    page.goto(f"{hub.url}/hub/login", timeout=30_000)
    page.fill("input[name=username]", name)
    page.fill("input[name=password]", PASSWORD)
    page.click("#login_submit")


def _stream(path: Path) -> str:
    nb = json.loads(path.read_text())
    return "".join(out.get("text", "") if isinstance(out.get("text", ""), str)
                   else "".join(out["text"])
                   for cell in nb["cells"] if cell["cell_type"] == "code"
                   for out in cell.get("outputs", []) if out["output_type"] == "stream")


def test_two_learners_on_the_classroom_hub(hub, browser):
    start = time.monotonic()
    names = workshop.learner_names(LEARNERS)[:2]
    for name in names:
        _write_settings(hub.home(name))
    contexts = [browser.new_context(viewport={"width": 1400, "height": 1000}) for _ in names]
    pages = [ctx.new_page() for ctx in contexts]
    try:
        for page in pages:
            page.set_default_timeout(30_000)
        # 1. Both log in at once; each lands, after the spawn, on lesson 00 in JupyterLab.
        for page, name in zip(pages, names):
            _login(page, hub, name)
        for page, name in zip(pages, names):
            # spawn + redirect; JupyterLab can show /lab/tree/lessons for a moment before the
            # notebook's own URL (seen under load in CI), so wait for where the learner lands
            page.wait_for_url(lambda url, name=name: f"/user/{name}/lab/" in url
                              and url.split("?")[0].endswith("/00_start_here.ipynb"),
                              timeout=120_000)
            assert page.url.split("?")[0].endswith("/lab/tree/lessons/00_start_here.ipynb")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)

        # 2. Their own copy, their own seat.
        seats = json.loads((hub.state / "seats.json").read_text())
        assert sorted(seats) == sorted(names) and len(set(seats.values())) == 2
        gpus, cores, memory = workshop.machine()
        plan = workshop.learner_settings(LEARNERS, gpus, cores, memory_gib=memory)
        copies = [hub.home(name) / "dpcourse" for name in names]
        for copy in copies:
            for part in ("lessons/00_start_here.ipynb", "lessons/03_ddp_first_principles.ipynb",
                         "labs/lab03_ddp_first_principles.ipynb"):
                assert (copy / part).is_file(), part
        # 3. A notebook per learner: the environment, lesson 03's launch, and for the first
        #    learner lab03's check; both run from the Run menu at the same time.
        for i, (copy, name) in enumerate(zip(copies, names)):
            cells = [ENV_CELL, LAUNCH_CELL] + ([LAB_CELL] if i == 0 else [])
            nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
            nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                         "language": "python"}
            nbformat.write(nb, copy / NOTEBOOK)
        servers = [LearnerServer(page, hub, name) for page, name in zip(pages, names)]
        for page, server in zip(pages, servers):
            page.goto(server.url(NOTEBOOK), timeout=90_000)
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
            wait_for_kernel(page, server, NOTEBOOK, limit_s=90)
        for page in pages:
            run_menu(page, "Run All Cells")
        for page in pages:
            wait_until_done(page, limit_s=240)  # both launches, then the lab check
            save(page)
        ran_at_once = time.monotonic() - start

        outputs = [_stream(copy / NOTEBOOK) for copy in copies]
        for copy, out in zip(copies, outputs):
            assert saved_errors(copy / NOTEBOOK) == [], out
        for name, copy, out in zip(names, copies, outputs):
            env_line = next(line for line in out.splitlines() if line.startswith("ENV "))
            seen = json.loads(env_line[4:])
            seat = plan[seats[name]]
            assert seen["JUPYTERHUB_USER"] == name and seen["DPCOURSE_SEAT"] == str(seat.learner)
            for key in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "DPCOURSE_PROFILE"):
                assert seen[key] == seat.env[key], (name, key, seen[key], seat.env[key])
            assert seen["threads"] == int(seat.env["OMP_NUM_THREADS"])
            assert seen["DPCOURSE_PROGRESS"] == str(hub.state / "progress.jsonl")
            assert seen["DPCOURSE_EDITION"] == "en"  # the class's edition, by default
            assert Path(seen["cwd"]).resolve() == copy.resolve()  # its own copy, as its root
            assert Path(seen["python"]).resolve().parent == Path(sys.executable).resolve().parent
            assert "✔ weights after 10 steps: DDP == one process (to 1e-5)" in out
            assert "LAUNCH 2 ranks over gloo" in out
        assert "✔ average_gradients" in outputs[0]
        assert "every p.grad is the mean over the ranks" in outputs[0]
        assert "average_gradients" not in outputs[1]

        # 4. The class table from the progress file the lab check wrote.
        table = subprocess.run([sys.executable, "-m", "dpcourse", "progress",
                                str(hub.state / "progress.jsonl")], capture_output=True,
                               text=True, timeout=60)
        assert table.returncode == 0, table.stderr
        assert names[0] in table.stdout and "✔" in table.stdout
        (ARTIFACTS / "hub_progress.txt").write_text(table.stdout)
        print(f"\nboth learners done {ran_at_once:.0f} s after the first login; the class "
              f"table:\n{table.stdout}")
        for page, name in zip(pages, names):
            page.screenshot(path=str(ARTIFACTS / f"hub-{name}.png"))
    finally:
        for ctx in contexts:
            ctx.close()

    # 5. Stop the hub: nothing of it may be left running or listening.
    before = {hub.proc.pid: "jupyterhub", **_descendants(hub.proc.pid)}
    ports = set(hub.ports) | _listening(before)
    assert len(before) >= 5, before  # hub, proxy, two servers, their kernels
    hub.proc.send_signal(signal.SIGTERM)
    hub.proc.wait(timeout=60)  # the hub stops every server and the proxy first
    import psutil

    deadline = time.monotonic() + 15  # exiting processes and sockets going away
    while time.monotonic() < deadline:
        alive = [pid for pid in before if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        bound = [p for p in ports if workshop.port_is_bound(p)]
        if not alive and not bound and not _ours(hub.state):
            break
        time.sleep(0.25)
    assert not alive, [before[p] for p in alive]
    assert not bound, bound
    assert _ours(hub.state) == []


def test_a_learner_set_to_zh_lands_on_the_chinese_lesson_00(hub, browser):
    # The instructor sets learner03 to the Chinese edition while the hub runs (the file is read
    # at each server start); the class stays English.
    name = workshop.learner_names(LEARNERS)[2]
    (hub.state / "editions.json").write_text(json.dumps({name: "zh"}))
    _write_settings(hub.home(name))
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = context.new_page()
        page.set_default_timeout(30_000)
        _login(page, hub, name)
        page.wait_for_url(lambda url: f"/user/{name}/lab/" in url  # spawn + redirect (as above)
                          and url.split("?")[0].endswith("/00_start_here.ipynb"), timeout=120_000)
        assert page.url.split("?")[0].endswith("/lab/tree/zh/lessons/00_start_here.ipynb"), page.url
        heading = page.locator(".jp-NotebookPanel .jp-MarkdownCell h1").first
        heading.wait_for(timeout=90_000)
        assert "从这里开始" in heading.inner_text()
        page.screenshot(path=str(ARTIFACTS / f"hub-{name}-zh.png"))
    finally:
        context.close()
    copy = hub.home(name) / "dpcourse"
    for part in ("zh/lessons/00_start_here.ipynb", "zh/labs/lab03_ddp_first_principles.ipynb",
                 "lessons/00_start_here.ipynb"):
        assert (copy / part).is_file(), part
    # the learner's server (and so each kernel it starts) has the edition in its environment
    import psutil

    servers = []
    for pid in _descendants(hub.proc.pid):
        try:
            env = psutil.Process(pid).environ()
        except psutil.Error:
            continue
        if env.get("JUPYTERHUB_USER") == name and "DPCOURSE_SEAT" in env:
            servers.append(env)
    assert servers, "no server process for " + name
    assert {env["DPCOURSE_EDITION"] for env in servers} == {"zh"}
    assert {env["JUPYTERHUB_DEFAULT_URL"] for env in servers} == {
        "/lab/tree/zh/lessons/00_start_here.ipynb"}
