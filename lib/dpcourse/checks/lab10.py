"""Check for lab 10: five broken torchrun scripts; the learner names each bug and fixes it.

The scripts live in ``lib/dpcourse/scripts/lab10/`` (:func:`script` reads one, :func:`show`
prints it with line numbers and the multiple-choice options). Each trains the same tiny model
on the same tiny data for three epochs on every rank and saves rank 0's weights to ``--out``:

1. ``bug1_seeds.py`` — each rank seeds with ``seed + rank``: the replicas start different;
2. ``bug2_loss.py``  — the loss is averaged over the ranks, the gradients never are;
3. ``bug3_epoch.py`` — ``sampler.set_epoch`` is never called: every epoch has the same order;
4. ``bug4_log.py``   — only rank 0 calls ``all_reduce`` (to log): the collectives mismatch;
5. ``bug5_sum.py``   — the gradients are summed and not divided by the world size.

:func:`check_answer` judges a multiple-choice answer and says why a wrong option is not it.
:func:`check_fixes` runs the fixed scripts under torchrun (all at once, for time), loads the
weights each one saved, and compares them with :func:`simulate`: the same training, every
rank's replica in this one process, done right. A data-parallel run done right equals it to
float tolerance; when a fix does not, :func:`simulate` replays each bug, and the check names
the bug whose weights the script reproduced. Bug 5's fix runs on 3 ranks (a ``/ 2`` is right
on 2 ranks only), every fix with ``--seed 3`` (a fix that hard-codes the seed fails).

Stretch: :func:`check_replicas_in_sync` — the learner's detector for bug 1, run on 3 ranks.
Used in solutions/lab10_bug_hunt.py; tests in tests/test_lab10_checks.py.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dpcourse import launch
from dpcourse.checks import fail, passed

__all__ = ["SCRIPTS", "CHOICES", "ANSWERS", "BUGS", "script", "show", "check_answer",
           "simulate", "run_fix", "judge_fix", "check_fix", "check_fixes",
           "check_replicas_in_sync"]

SCRIPT_DIR = Path(__file__).resolve().parents[1] / "scripts" / "lab10"
SCRIPTS = {1: "bug1_seeds.py", 2: "bug2_loss.py", 3: "bug3_epoch.py", 4: "bug4_log.py",
           5: "bug5_sum.py"}
SEED = 3  # the check's --seed: not the scripts' default, so a hard-coded seed shows
WORLD_SIZES = {1: 2, 2: 2, 3: 2, 4: 2, 5: 3}
TOL = 1e-5  # float drift measured at ~1e-7; every bug lands 1e-2 or more away

# bug -> [(option, why it is not the bug, or None for the right one)]
CHOICES = {
    1: [("A", "The gradients are summed over the ranks, not averaged.",
         "the loop divides every gradient by world_size right after all_reduce: they are "
         "averaged."),
        ("B", "Each rank seeds its own random stream, so the replicas start from different "
              "weights, and nothing ever makes them equal.", None),
        ("C", "Every rank reads the same batches.",
         "DistributedSampler gives each rank its own shard, and set_epoch is called."),
        ("D", "Only rank 0 saves, so what rank 1 learned is lost.",
         "saving on rank 0 only is right: when the replicas agree, rank 0 holds everything.")],
    2: [("A", "all_reduce on the loss changes the gradients of the next step.",
         "the loss is detached and cloned before all_reduce, after backward and the step: the "
         "gradients never see it."),
        ("B", "The logged loss must be summed over the ranks, not averaged.",
         "the logged number is only printed: how it is reduced cannot change the weights."),
        ("C", "Only the loss is averaged over the ranks; the gradients never are, so each rank "
              "trains its own model on its own shard.", None),
        ("D", "The replicas start from different weights.",
         "every rank seeds with args.seed, so the replicas start equal.")],
    3: [("A", "sampler.set_epoch is never called, so every epoch reads its shard in the same "
              "order.", None),
        ("B", "DDP needs find_unused_parameters=True here.",
         "every parameter is used at every step; the flag matters only when some are not."),
        ("C", "The gradients are not averaged by hand after backward.",
         "DDP averages them during backward; averaging them again would do nothing useful."),
        ("D", "Rank 0 should save model.state_dict(), not model.module.state_dict().",
         "model.module.state_dict() is right: the plain model's keys, without 'module.'.")],
    4: [("A", "Printing from one rank only is not allowed under torchrun.",
         "printing on one rank is fine; the problem is the collective inside that if."),
        ("B", "loss.item() synchronises the ranks.",
         ".item() waits for this rank's own computation only: it is no collective."),
        ("C", "The logged loss is divided by world_size twice.",
         "it is divided once, in the print, and a printed number cannot crash a run."),
        ("D", "Only rank 0 calls all_reduce, so the ranks' collectives no longer match: the "
              "run crashes or hangs.", None)],
    5: [("A", "all_reduce already averages, so the gradients are divided twice.",
         "dist.all_reduce sums by default (ReduceOp.SUM), and nothing divides afterwards."),
        ("B", "Momentum must be turned off in data-parallel training.",
         "momentum works as on one device as long as the gradients are right."),
        ("C", "The gradients are summed over the ranks but never divided by the world size: "
              "every step is world_size times too large.", None),
        ("D", "A manual all_reduce can never match DDP: wrap the model in DDP.",
         "all-reducing every gradient and dividing by the world size is what DDP does "
         "(lesson 03), only slower.")],
}
ANSWERS = {n: next(o for o, _, why in opts if why is None) for n, opts in CHOICES.items()}

# variant name -> the sentence the learner reads when a "fixed" script reproduces that bug
BUGS = {
    "seeds": "the replicas still start from different weights: seed the model with args.seed "
             "on every rank (or broadcast rank 0's weights before training).",
    "seed_ignored": "the model's seed no longer comes from --seed: seed it with args.seed (the "
                    "same on every rank), not with a number.",
    "no_grad_sync": "the gradients are still not averaged over the ranks: all_reduce every "
                    "p.grad after backward and divide it by world_size (the loss is only "
                    "logged).",
    "no_set_epoch": "every epoch still reads the same order: call sampler.set_epoch(epoch) at "
                    "the start of each epoch.",
    "grad_sum": "the gradients are still summed, not averaged: divide each by world_size after "
                "all_reduce (or use ReduceOp.AVG).",
    "halved": "on 3 ranks the gradients were divided by 2: divide by world_size, not by a "
              "number true on 2 ranks only.",
}


def script(n: int) -> str:
    """The text of broken script ``n`` (1 to 5)."""
    if n not in SCRIPTS:
        raise ValueError(f"there are five scripts, 1 to 5; got {n!r}")
    return (SCRIPT_DIR / SCRIPTS[n]).read_text()


def show(n: int) -> None:
    """Print script ``n`` with line numbers, then the options for its bug."""
    print(f"--- {SCRIPTS[n]} ---")
    for i, line in enumerate(script(n).splitlines(), 1):
        print(f"{i:3d}  {line}")
    print(f"\nWhat is the bug in {SCRIPTS[n]}?")
    for option, text, _ in CHOICES[n]:
        print(f"  {option}. {text}")


def check_answer(n: int, answer) -> None:
    """Judge the multiple-choice answer for bug ``n``: say why a wrong option is not it."""
    __tracebackhide__ = True
    if n not in CHOICES:
        raise ValueError(f"there are five bugs, 1 to 5; got {n!r}")
    letters = [o for o, _, _ in CHOICES[n]]
    if not isinstance(answer, str) or answer.strip().upper() not in letters:
        fail(f"Answer bug {n} with one letter among {', '.join(letters)}; got {answer!r}.")
    answer = answer.strip().upper()
    why = next(w for o, _, w in CHOICES[n] if o == answer)
    if why is not None:
        fail(f"Bug {n} is not {answer}: {why}")
    passed(f"bug {n}: {next(t for o, t, _ in CHOICES[n] if o == answer)}")


# --- the reference: every rank's replica in one process ------------------------------------

def _data():
    import torch

    g = torch.Generator().manual_seed(1234)
    X = torch.randn(48, 6, generator=g)
    y = torch.tanh(X @ torch.randn(6, 1, generator=g))
    return X, y


@functools.lru_cache(maxsize=32)
def _simulate(world_size: int, seed: int, variant: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    known = ("correct", *BUGS)
    if variant not in known:
        raise ValueError(f"unknown variant {variant!r}: one of {known}")
    X, y = _data()
    ds = TensorDataset(X, y)
    samplers = [DistributedSampler(ds, num_replicas=world_size, rank=r, seed=seed)
                for r in range(world_size)]
    loaders = [DataLoader(ds, batch_size=4, sampler=s) for s in samplers]
    models, opts = [], []
    for r in range(world_size):
        torch.manual_seed({"seeds": seed + r, "seed_ignored": 0}.get(variant, seed))
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    divide = {"grad_sum": 1, "halved": 2}.get(variant, world_size)
    for epoch in range(3):
        if variant != "no_set_epoch":
            for s in samplers:
                s.set_epoch(epoch)
        for batches in zip(*loaders):
            for m, o, (xb, yb) in zip(models, opts, batches):
                o.zero_grad()
                F.mse_loss(m(xb), yb).backward()
            if variant != "no_grad_sync":
                for ps in zip(*(m.parameters() for m in models)):
                    total = ps[0].grad.clone()
                    for p in ps[1:]:
                        total += p.grad
                    for p in ps:
                        p.grad.copy_(total / divide)
            for o in opts:
                o.step()
    return {k: v.detach().clone() for k, v in models[0].state_dict().items()}


def simulate(world_size: int = 2, seed: int = SEED, variant: str = "correct") -> dict:
    """Rank 0's final weights for the lab's training on ``world_size`` ranks, done right
    (``"correct"``) or with one of the bugs in :data:`BUGS`, all replicas in this process."""
    return {k: v.clone() for k, v in _simulate(world_size, seed, variant).items()}


def _distance(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].shape == b[k].shape
               else float("inf") for k in a)


# --- running a fixed script ----------------------------------------------------------------

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
    for line in reversed(text.splitlines()):
        line = re.sub(r"^\[rank \d+\]\s*(\[rank\d+\]:\s*)?", "", line).strip()
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:", line):
            return line
        if "SIGABRT" in line or "Signal 6" in line:
            return "a rank was aborted (SIGABRT)"
    return "see its output"


def _precheck(n: int, text) -> None:
    """Everything that needs no launch: a TODO left, not a script, unchanged, not Python."""
    __tracebackhide__ = True
    if n not in SCRIPTS:
        raise ValueError(f"there are five scripts, 1 to 5; got {n!r}")
    if text is None or text is Ellipsis or "NotImplementedError" in str(text):
        raise NotImplementedError(f"the fix for bug {n} is still a TODO: write the fixed "
                                  f"script's text, then run this check.")
    if not isinstance(text, str):
        fail(f"The fix for bug {n} should be the fixed script's text (a str), got "
             f"{type(text).__name__}.")
    if text.strip() == script(n).strip():
        fail(f"The fix for bug {n} is the broken script unchanged: did the replace() find "
             f"the text it looks for?")
    try:
        compile(text, SCRIPTS[n], "exec")
    except SyntaxError as err:
        fail(f"The fix for bug {n} is not valid Python (line {err.lineno}: {err.msg}).")


# How a collective that only some ranks call shows itself. Which one a learner sees depends on
# timing: the rank left waiting is aborted (SIGABRT, "died"), or its gloo socket is closed
# under it when the other rank exits (launch.PEER_LOST: "Connection reset by peer" ... "a
# remote worker hanging"). Seen in CI on a loaded 2-core machine: the second form.
_MISMATCHED = re.compile(r"signal|SIGABRT|died|" + launch.PEER_LOST.pattern, re.I)
_MISMATCH_HINT = " - every rank must call the same collectives in the same order"


def run_fix(n: int, text: str, timeout: float = 60.0, launcher: str = "torchrun"):
    """Run fixed script ``n`` under torchrun; return rank 0's weights, or the sentence that
    says why there are none (a crash, a hang, no file). ``launcher="spawn"`` runs the same
    script in ``dpcourse.launch.spawn`` ranks (same environment variables, lab04's runner),
    which the tests use because it starts in a second instead of seven."""
    import torch

    from dpcourse import launch

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
                return (f"it did not finish within {timeout:g} s: a rank is waiting in a "
                        f"collective that another rank never calls.")
            except launch.RankFailedError as exc:
                hint = _MISMATCH_HINT if _MISMATCHED.search(exc.summary) else ""
                return f"it failed on rank {exc.rank} ({exc.summary}){hint}."
        elif launcher != "torchrun":
            raise ValueError(f"launcher must be 'torchrun' or 'spawn', got {launcher!r}")
        else:
            try:
                result = launch.torchrun(runner, str(path), "--seed", str(SEED), "--out", out,
                                         nproc_per_node=WORLD_SIZES[n], timeout=timeout,
                                         echo=False, check=False)
            except launch.LaunchTimeoutError:
                return (f"it did not finish within {timeout:g} s: a rank is waiting in a "
                        f"collective that another rank never calls.")
            if result.returncode != 0:
                hint = (_MISMATCH_HINT if _MISMATCHED.search(_last_error_line(result.output))
                        else "")
                return f"it failed under torchrun ({_last_error_line(result.output)}){hint}."
        if not os.path.exists(out):
            return "it wrote no weights to --out: keep rank 0's torch.save."
        try:
            state = torch.load(out, map_location="cpu", weights_only=True)
        except Exception as exc:
            return f"the file it wrote to --out cannot be loaded ({type(exc).__name__})."
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        return "--out should hold the model's state_dict."
    return state


def judge_fix(n: int, weights) -> None:
    """Nothing if ``weights`` (or the sentence :func:`run_fix` returned) are right for bug
    ``n``; else fail naming the bug the weights reproduce."""
    __tracebackhide__ = True
    if isinstance(weights, str):
        fail(f"Fix {n}: {weights}")
    ws = WORLD_SIZES[n]
    want = simulate(ws)
    d = _distance(weights, want)
    if d <= TOL:
        return
    for name, sentence in BUGS.items():
        if _distance(weights, simulate(ws, variant=name)) <= TOL:
            fail(f"Fix {n}: {sentence}")
    fail(f"Fix {n}: the final weights differ from a correct run on {ws} ranks by up to {d:.3g} "
         f"and match none of the five bugs: change only what the bug needs.")


def check_fix(n: int, text: str, timeout: float = 60.0, launcher: str = "torchrun") -> None:
    """Run one fixed script under torchrun and compare its weights with the reference."""
    __tracebackhide__ = True
    _precheck(n, text)
    judge_fix(n, run_fix(n, text, timeout, launcher))
    passed(f"fix {n}: the weights equal a correct data-parallel run on {WORLD_SIZES[n]} ranks")


def check_fixes(fixes: dict, timeout: float = 60.0, launcher: str = "torchrun") -> None:
    """Run every fixed script under torchrun at the same time (a launch costs seconds) and
    judge each, in order."""
    __tracebackhide__ = True
    if not isinstance(fixes, dict) or not fixes:
        fail("Pass a dict {bug number: fixed script text}, e.g. {1: fixed1, 2: fixed2}.")
    for n in sorted(fixes):
        _precheck(n, fixes[n])
    with ThreadPoolExecutor(max_workers=len(fixes)) as pool:
        results = dict(zip(sorted(fixes), pool.map(
            lambda n: run_fix(n, fixes[n], timeout, launcher), sorted(fixes))))
    for n in sorted(fixes):
        judge_fix(n, results[n])
    passed(f"fixes {', '.join(map(str, sorted(fixes)))}: every script ends with the weights "
           f"of a correct data-parallel run")


# --- stretch: a detector for bug 1 ---------------------------------------------------------

_CASES = ("same", "off_keeping_sum", "last_param_off")


def _detector_worker(rank, world_size, fn):
    __tracebackhide__ = True
    import torch

    results = {}
    for case in _CASES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 1))
        params = list(model.parameters())
        with torch.no_grad():
            if case == "off_keeping_sum" and rank == world_size - 1:
                params[0].view(-1)[0] += 1e-3  # the sum of everything stays the same
                params[0].view(-1)[1] -= 1e-3
            if case == "last_param_off" and rank == 1:
                params[-1].view(-1)[0] += 1e-3
        before = [p.detach().clone() for p in params]
        verdict = fn(model)
        if isinstance(verdict, torch.Tensor) and verdict.numel() == 1:
            verdict = bool(verdict.item())
        changed = any(not torch.equal(b, p) for b, p in zip(before, params))
        results[case] = (verdict if isinstance(verdict, bool) else repr(verdict), changed)
    return results


def check_replicas_in_sync(replicas_in_sync, world_size: int = 3, timeout: float = 60.0):
    """Stretch: on ``world_size`` ranks, ``replicas_in_sync(model)`` must return True on every
    rank when all replicas hold the same parameters, and False on every rank when one differs."""
    __tracebackhide__ = True
    from dpcourse import launch
    from dpcourse.checks import has_todo

    if not callable(replicas_in_sync):
        fail(f"replicas_in_sync must be a function, got {type(replicas_in_sync).__name__}.")
    if has_todo(replicas_in_sync):
        raise NotImplementedError("replicas_in_sync still has a TODO: write it, then run this "
                                  "check.")
    try:
        ranks = launch.spawn(_detector_worker, world_size, replicas_in_sync, backend="gloo",
                             timeout=timeout, show_output=False)
    except launch.LaunchTimeoutError:
        fail(f"replicas_in_sync did not return within {timeout:g} s on {world_size} ranks: does "
             f"it call a collective on some ranks only?")
    except launch.RankFailedError as exc:
        fail(f"replicas_in_sync raised on rank {exc.rank} of {world_size}: {exc.summary}")
    for case in _CASES:
        verdicts = [r[case][0] for r in ranks]
        if any(r[case][1] for r in ranks):
            fail("replicas_in_sync changed the model's parameters: a detector only compares "
                 "(broadcast or gather copies, never the parameters themselves).")
        bad = [v for v in verdicts if not isinstance(v, bool)]
        if bad:
            fail(f"replicas_in_sync should return True or False, got {bad[0]}.")
        want = case == "same"
        wrong = [r for r, v in enumerate(verdicts) if v != want]
        if not wrong:
            continue
        if len(set(verdicts)) > 1:
            fail(f"the ranks disagree (verdicts {verdicts} on ranks 0 to {world_size - 1}, "
                 f"when the replicas are {'equal' if want else 'not'}): every rank must "
                 f"return the same verdict - combine them with a collective.")
        if want:
            fail(f"with every replica identical, replicas_in_sync returned False on rank "
                 f"{wrong[0]}: compare the values exactly (or to a tiny tolerance).")
        if case == "off_keeping_sum":
            fail(f"rank {world_size - 1}'s replica differs (one weight +1e-3, another -1e-3) "
                 f"but replicas_in_sync returned True: a sum or checksum cannot see that; "
                 f"compare every value.")
        fail("rank 1's last parameter differs by 1e-3 but replicas_in_sync returned True: "
             "compare every parameter on every rank, not just some.")
    passed(f"replicas_in_sync: True on all {world_size} ranks for equal replicas, False on all "
           f"of them when one replica differs")
