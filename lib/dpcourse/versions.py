"""Are torch, TensorFlow and Python here the ones the course needs? One check, with the fix.

Every notebook's first cell calls :func:`check_versions` (silent when all is well, so stored
outputs stay the same), and ``python -m dpcourse doctor`` lists the same sentences::

    from dpcourse.versions import check_versions
    check_versions()   # one sentence per problem: what, why, the command that fixes it

A version below the floor gets the exact ``%pip install`` line that fixes it, the lessons known
to need more (by the names they call), and "then restart the kernel"; a release other than the
tested one gets a one-line note. ``FLOORS`` are pyproject.toml's lower bounds and ``TESTED``
requirements.txt's pins (tests/test_install.py keeps them equal). Reading versions uses package
metadata only: this module imports neither torch nor TensorFlow, and importing it prints nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from importlib import metadata

from packaging.version import InvalidVersion, Version

__all__ = ["FLOORS", "TESTED", "NEEDED_BY", "installed_versions", "version_problems",
           "check_versions"]

# The tested set (requirements.txt) and the floors (pyproject.toml) this check holds to.
TESTED = {"python": "3.11", "torch": "2.14.1", "torchvision": "0.29.1", "tensorflow": "2.21.0",
          "keras": "3.15.1"}
FLOORS = {"torch": "2.14", "torchvision": "0.29", "tensorflow": "2.21", "keras": "3.15"}
# Which lessons need which torch, by the names they call (the rest were not tried on older ones).
NEEDED_BY = {"torch": [
    ("2.14", "lab 08 calls dist.reduce_scatter_single and dist.all_gather_single (torch 2.14 names)"),
    ("2.13", "lesson 03 passes DDP(forward_sync_buffers=...) (torch 2.13)"),
]}
# Older releases the whole course was run on (doctor --run), and what that showed.
TRIED = {"torch": {
    "2.11": ("on torch 2.11 (one H100, doctor --run, 2026-11-27) lesson 03 and lab 08 failed, "
             "lessons 00 and 11 printed outputs other than the stored ones, and the other "
             "lessons and solutions ran"),
}}
_TF_NAMES = ("tensorflow", "tensorflow-cpu")   # the same release under two names (README)
_RESTART = "then restart the kernel (Colab: Runtime > Restart session)"


def _get(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    """What pip installed here (None when missing); TensorFlow under either of its names, plus
    the name it was installed as (``tensorflow-dist``) for the fix command."""
    tf_dist = next((d for d in _TF_NAMES if _get(d)), None)
    found = {name: _get(name) for name in ("torch", "torchvision", "keras")}
    found["tensorflow"] = _get(tf_dist) if tf_dist else None
    found["tensorflow-dist"] = tf_dist
    found["python"] = "{}.{}.{}".format(*sys.version_info[:3])
    return found


def _loaded_versions() -> dict[str, str]:
    """Versions of torch / TensorFlow already imported in this process (they win until restart)."""
    out = {}
    for name in ("torch", "tensorflow"):
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None)
        if isinstance(version, str):
            out[name] = version
    return out


def _v(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _older(found: str, floor: str) -> bool:
    v = _v(found)
    return v is not None and v < Version(floor)


def _public(text: str) -> str:
    """``2.14.1+cu130`` (torch.__version__) and ``2.14.1`` (its metadata) are one release."""
    v = _v(text)
    return v.public if v is not None else text


def _minor(v: Version) -> tuple[int, int]:
    return (v.major, v.minor)


def _pip(packages: list[str], notebook: bool) -> str:
    return ("%pip install " if notebook else "pip install ") + " ".join(packages)


def version_problems(installed: Mapping[str, str | None] | None = None,
                     loaded: Mapping[str, str] | None = None,
                     notebook: bool = True) -> list[str]:
    """One sentence per problem (empty when all is well): a version below the course's floor or
    one loaded in this kernel that differs from the one installed (each with the command that
    fixes it), and a note for a release other than the tested one. ``installed`` and ``loaded``
    default to this environment's; tests pass made-up versions. ``notebook`` picks ``%pip`` (a
    cell) or ``pip`` (a terminal) for the commands."""
    have = dict(installed_versions() if installed is None else installed)
    loaded = _loaded_versions() if loaded is None else loaded
    torch_fix = _pip([f"torch=={TESTED['torch']}", f"torchvision=={TESTED['torchvision']}"],
                     notebook)
    tf_dist = have.get("tensorflow-dist") or "tensorflow"
    tf_fix = _pip([f"{tf_dist}=={TESTED['tensorflow']}", f"keras=={TESTED['keras']}"], notebook)
    problems: list[str] = []

    python = _v(have.get("python") or "")
    if python is not None and python < Version("3.10"):
        problems.append(f"Python {python} is too old: the course needs 3.10 or newer (torch "
                        f"{TESTED['torch']} has no wheel for it); tested on {TESTED['python']}.")
    elif python is not None and _minor(python) != _minor(Version(TESTED["python"])):
        problems.append(f"note: Python {python.major}.{python.minor} is expected to work, but "
                        f"the course is tested on {TESTED['python']} only.")

    torch = have.get("torch")
    tv = _v(torch) if torch else None
    if torch is None:
        problems.append(f"torch is not installed: every lesson needs torch {FLOORS['torch']} or "
                        f"newer. Run `{torch_fix}`, {_RESTART}.")
    elif tv is not None and tv < Version(FLOORS["torch"]):
        needs = [why for at, why in NEEDED_BY["torch"] if tv < Version(at)]
        tried = TRIED["torch"].get(f"{tv.major}.{tv.minor}",
                                   f"the other lessons were not tried on {tv.major}.{tv.minor}")
        problems.append(f"torch {torch} is older than the course needs ({FLOORS['torch']} or "
                        f"newer): " + "; ".join(needs + [tried]) + f". Run `{torch_fix}`, "
                        f"{_RESTART}.")
    elif tv is not None and _minor(tv) != _minor(Version(TESTED["torch"])):
        problems.append(f"note: torch {torch} is not the tested release ({TESTED['torch']}): "
                        f"nothing is known to break, but an output may differ from the stored "
                        f"one; `{torch_fix}` gives the tested one.")
    vision = have.get("torchvision")
    if (torch is not None and not (tv is not None and tv < Version(FLOORS["torch"]))
            and vision is not None and _older(vision, FLOORS["torchvision"])):
        problems.append(f"torchvision {vision} is older than the course needs "
                        f"({FLOORS['torchvision']}, the release for torch {FLOORS['torch']}). "
                        f"Run `{torch_fix}`, {_RESTART}.")

    old_tf = [f"{name} {have[name]}" for name in ("tensorflow", "keras")
              if have.get(name) is not None and _older(have[name], FLOORS[name])]
    if old_tf:
        problems.append(f"{' and '.join(old_tf)}: older than lesson 05 and lab 05 are tested "
                        f"with (TensorFlow {FLOORS['tensorflow']}, Keras {FLOORS['keras']}; the "
                        f"other lessons do not use them). Run `{tf_fix}`, {_RESTART}.")

    for name, running in loaded.items():
        on_disk = have.get(name)
        if on_disk is not None and _public(running) != _public(on_disk):
            problems.append(f"{name} {running} is loaded in this kernel but {on_disk} is "
                            f"installed (pip changed it after the import): restart the kernel.")
    return problems


def check_versions(notebook: bool = True) -> None:
    """Print :func:`version_problems` for this environment, one per line; nothing when all is
    well. Returns None, so a notebook cell that ends with it displays nothing else."""
    for line in version_problems(notebook=notebook):
        print(line)
