"""The repository's own promises: Binder installs what requirements.txt pins, the README's
commands are the ones CI runs, and nothing imports as a side effect."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins(path):
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def test_binder_pins_equal_requirements():
    req = _pins(ROOT / "requirements.txt")
    binder = _pins(ROOT / "binder" / "requirements.txt")
    assert req and binder == req


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"<!-- install -->\s*```bash\n(.*?)\n```", readme, re.S).group(1)
    test = re.search(r"<!-- test -->\s*```bash\n(.*?)\n```", readme, re.S).group(1)
    assert "pip install -r requirements.txt" in install
    # CI takes both commands out of README rather than keeping copies that could drift
    assert "readme_block install" in ci and "readme_block test" in ci
    assert test.strip().startswith("python -m pytest")
    # the real-browser tests are their own README command, which CI runs after the suite
    browser = re.search(r"<!-- browser -->\s*```bash\n(.*?)\n```", readme, re.S).group(1)
    assert "readme_block browser" in ci and "python -m pytest tests/browser" in browser


def test_importing_the_library_has_no_side_effects():
    code = ("import sys, dpcourse, dpcourse.devices, dpcourse.launch, dpcourse.data, "
            "dpcourse.models, dpcourse.train, dpcourse.checks, dpcourse.tools.authoring, dpcourse.bench; "
            "assert 'tensorflow' not in sys.modules, 'torch-only modules imported TensorFlow'; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_repository_address_is_written_once():
    """README's clone command and Binder link use pyproject's [project.urls] Repository, and no
    placeholder such as <owner> is left for a learner to fill in."""
    import tomllib

    url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    owner_repo = url.removeprefix("https://github.com/")
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("<!-- install -->", 1)[0]
    assert f"git clone {url}.git" in quick and "\ncd " + owner_repo.split("/")[1] in quick
    assert f"mybinder.org/v2/gh/{owner_repo}/main" in readme
    assert "<owner>" not in readme
