"""Lab 10: running a fixed script (solutions/lab10_bug_hunt.py, "Check the five fixes") under
torchrun — or, in the tests, in ``dpcourse.launch.spawn`` ranks — with the check's ``--seed``
and number of ranks, and reading back the weights rank 0 saved, or the sentence that says why
there are none (a crash, with the child's own error line and what it means here; a hang; no
file).

Exported by :mod:`dpcourse.checks.lab10`, whose checks call :func:`run_fix`.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from dpcourse import launch
from dpcourse.checks import timed_out
from dpcourse.checks._lab10_scripts import SCRIPTS, SEED, WORLD_SIZES

__all__ = ["run_fix"]

_RUNNER = '''\
import os, runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
# leave without interpreter shutdown, where gloo + DDP now and then abort a finished process
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


def _last_error_line(text: str) -> str:
    """The exception a rank raised, from torchrun's output: the child's own error line, not the
    agent's ``ChildFailedError`` that wraps every failed child."""
    for line in reversed(text.splitlines()):
        line = re.sub(r"^\[rank \d+\]\s*(\[rank\d+\]:\s*)?", "", line).strip()
        if "ChildFailedError" in line or "torch.distributed.elastic" in line:
            continue
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:", line):
            return line
        if "SIGABRT" in line or "Signal 6" in line:
            return "a rank was aborted (SIGABRT)"
    return "see its output"


# How a collective that only some ranks call shows itself. Which one a learner sees depends on
# timing: the rank left waiting is aborted (SIGABRT, "died"), or its gloo socket is closed
# under it when the other rank exits (launch.PEER_LOST: "Connection reset by peer" ... "a
# remote worker hanging"). Seen in CI on a loaded 2-core machine: the second form.
_MISMATCHED = re.compile(r"signal|SIGABRT|died|" + launch.PEER_LOST.pattern, re.I)
_MISMATCH_HINT = " - every rank must call the same collectives in the same order"


# errors torch raises for a fix, and what they mean here
_KNOWN_ERRORS = {
    "mutually exclusive with shuffle":
        " - a DataLoader takes a sampler or shuffle=True, not both: with a sampler, the "
        "sampler decides the order (DistributedSampler shuffles by default)",
}


def _known(error: str) -> str:
    return next((hint for piece, hint in _KNOWN_ERRORS.items() if piece in error), "")


def run_fix(n: int, text: str, timeout: float = 60.0, launcher: str = "torchrun"):
    """Run fixed script ``n`` under torchrun; return rank 0's weights, or the sentence that
    says why there are none (a crash, a hang, no file). ``launcher="spawn"`` runs the same
    script in ``dpcourse.launch.spawn`` ranks (same environment variables, lab04's runner),
    which the tests use because it starts in a second instead of seven."""
    import torch

    from dpcourse import launch

    hang = timed_out(f"it did not finish within {timeout:g} s: a rank is waiting in a collective "
                     f"that the others never call, or call differently (another src, order or "
                     f"shape)", timeout)
    with tempfile.TemporaryDirectory(prefix=f"dpcourse-lab10-bug{n}-") as tmp:
        path, runner = Path(tmp, SCRIPTS[n]), Path(tmp, "runner.py")
        path.write_text(text)
        runner.write_text(_RUNNER)
        out = os.path.join(tmp, "final.pt")
        if launcher == "spawn":
            from dpcourse.checks.lab04 import _spawn_worker

            try:
                launch.spawn(_spawn_worker, WORLD_SIZES[n], str(path), ["--seed", str(SEED),
                             "--out", out], os.path.join(tmp, "saves"), timeout=timeout,
                             show_output=False)
            except launch.LaunchTimeoutError:
                return hang
            except launch.RankFailedError as exc:
                hint = _MISMATCH_HINT if _MISMATCHED.search(exc.summary) else _known(exc.summary)
                return f"it failed on rank {exc.rank} ({exc.summary}){hint}."
        elif launcher != "torchrun":
            raise ValueError(f"launcher must be 'torchrun' or 'spawn', got {launcher!r}")
        else:
            try:
                result = launch.torchrun(runner, str(path), "--seed", str(SEED), "--out", out,
                                         nproc_per_node=WORLD_SIZES[n], timeout=timeout,
                                         echo=False, check=False)
            except launch.LaunchTimeoutError:
                return hang
            if result.returncode != 0:
                error = _last_error_line(result.output)
                hint = _MISMATCH_HINT if _MISMATCHED.search(error) else _known(error)
                return f"it failed under torchrun ({error}){hint}."
        if not os.path.exists(out):
            return "it wrote no weights to --out (rank 0's torch.save is gone, or never ran)."
        try:
            state = torch.load(out, map_location="cpu", weights_only=True)
        except Exception as exc:
            return f"the file it wrote to --out cannot be loaded ({type(exc).__name__})."
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        return "--out should hold the model's state_dict."
    return state
