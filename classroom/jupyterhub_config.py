"""JupyterHub for a dpcourse classroom: one shared server, one Jupyter server per learner.

Start it from the repository root, in the course's environment (classroom/README.md):

    jupyterhub -f classroom/jupyterhub_config.py

Each learner's server gets, from ``dpcourse.tools.workshop`` (the same plan
``python -m dpcourse workshop-check --plan`` prints):

* their seat, kept across restarts in ``state/seats.json``: ``CUDA_VISIBLE_DEVICES``,
  ``OMP_NUM_THREADS`` and ``DPCOURSE_PROFILE`` in the server's environment, the server pinned to
  the seat's cores (taskset), and ``DPCOURSE_PROGRESS`` naming the class's progress file
  (``python -m dpcourse progress classroom/state/progress.jsonl`` prints the table);
* this Python environment (the course's venv) for the server and so for its kernel;
* their own copy of the course in ``~/dpcourse`` (with ``zh/``, the Chinese edition), made at
  their first start, never overwriting a file they have (a file they delete comes back fresh at
  their next start);
* their edition, ``en`` or ``zh``: ``DPCOURSE_EDITION`` in the server's environment, and that
  edition's lesson 00 as the page that opens (``lessons/00_start_here.ipynb`` or
  ``zh/lessons/00_start_here.ipynb``).

Settings from the environment:

* ``DPCOURSE_LEARNERS`` — how many learners (default 20); the rehearsal accounts are
  learner01 ... learnerNN;
* ``DPCOURSE_CLASSROOM_STATE`` — the hub's folder: database, cookie secret, seats, progress file
  and (rehearsal spawner) the learners' homes (default: classroom/state);
* ``DPCOURSE_HUB_SPAWNER`` — ``simple`` (default, for a rehearsal: every learner runs as the
  user who started the hub, homes under the state folder), ``local`` (real Unix accounts: the
  hub runs as root) or ``systemd`` (real accounts with enforced limits: pip install
  jupyterhub-systemdspawner);
* ``DPCOURSE_EDITION`` — the class's edition, ``en`` (default) or ``zh`` (Chinese). A learner
  whose edition differs is listed in ``editions.json`` in the state folder, which an instructor
  writes, e.g. ``{"learner03": "zh", "learner07": "en"}``; it is read at each server start, so an
  edit applies at that learner's next start (Hub Control Panel: stop their server). A bad value
  in either stops the hub at its start, or that learner's spawn, with one line naming the
  variable or the file and the allowed values.

The GPUs, cores and memory of the plan are this machine's. Anything here can be overridden on
the command line, e.g. ``--JupyterHub.bind_url=http://0.0.0.0:8000`` for the room (behind
HTTPS: see JupyterHub's security docs).
"""

import os
from pathlib import Path

from dpcourse.tools import workshop

c = get_config()  # noqa: F821 — JupyterHub provides get_config when it loads this file

HERE = Path(__file__).resolve().parent
STATE = Path(os.environ.get("DPCOURSE_CLASSROOM_STATE", HERE / "state")).resolve()
STATE.mkdir(parents=True, exist_ok=True)
LEARNERS = int(os.environ.get("DPCOURSE_LEARNERS", "20"))
SPAWNER = os.environ.get("DPCOURSE_HUB_SPAWNER", "simple")

# --- the hub itself: on this machine only until you open it to the room ----------------------
c.JupyterHub.bind_url = "http://127.0.0.1:8000"
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
proxy = HERE / "node_modules" / ".bin" / "configurable-http-proxy"  # npm ci --prefix classroom
if proxy.exists():
    c.ConfigurableHTTPProxy.command = [str(proxy)]
c.JupyterHub.cleanup_servers = True  # stopping the hub stops every learner's server
c.JupyterHub.concurrent_spawn_limit = max(20, LEARNERS)  # the whole room logs in at once

# --- who may log in ---------------------------------------------------------------------------
# Rehearsal: DummyAuthenticator accepts any password for the listed accounts. NEVER open a hub
# with it to a network.
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = set(workshop.learner_names(LEARNERS))
# For the room, one of:
#   real Unix accounts (the hub runs as root; pair with DPCOURSE_HUB_SPAWNER=local or systemd):
#     c.JupyterHub.authenticator_class = "pam"
#     c.Authenticator.allowed_users = {"alice", "bob", ...}
#   one shared password handed out in the room (JupyterHub >= 5.3):
#     c.JupyterHub.authenticator_class = "shared-password"
#     c.SharedPasswordAuthenticator.user_password = "..."   # 8+ characters
#   the institution's logins (pip install oauthenticator), e.g. GitHub:
#     c.JupyterHub.authenticator_class = "github"
#     c.GitHubOAuthenticator.oauth_callback_url = "https://HOST/hub/oauth_callback"
#     c.GitHubOAuthenticator.client_id = ...; c.GitHubOAuthenticator.client_secret = ...
# An instructor account that can open any learner's server:
#     c.Authenticator.admin_users = {"instructor"}

# --- how each learner's server starts ---------------------------------------------------------
# The seats, the learner's copy of the course, their edition's lesson 00, this environment as
# the kernel.
workshop.configure_hub(c, learners=LEARNERS, state=STATE, edition=workshop.class_edition())

if SPAWNER == "simple":
    # Every learner runs as the user who started the hub, in a home of their own; no isolation
    # between learners (JupyterHub says: for testing only). Limits are not enforced.
    c.JupyterHub.spawner_class = "simple"
    c.SimpleLocalProcessSpawner.home_dir_template = str(STATE / "home" / "{username}")
    if os.geteuid() == 0:  # a hub started as root (a container, CI): Jupyter refuses without it
        c.Spawner.args = c.Spawner.args + ["--allow-root"]
elif SPAWNER == "local":
    # Real Unix accounts, each learner's server as that user. Limits are not enforced.
    c.JupyterHub.spawner_class = "localprocess"
elif SPAWNER == "systemd":
    # Real Unix accounts, each server a systemd unit: cpu_limit and mem_limit are enforced
    # (CPUQuota, MemoryMax). Needs: pip install jupyterhub-systemdspawner.
    c.JupyterHub.spawner_class = "systemdspawner.SystemdSpawner"
else:
    raise ValueError(f"DPCOURSE_HUB_SPAWNER={SPAWNER!r}: use simple, local or systemd")

