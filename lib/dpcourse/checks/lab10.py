"""Check for lab 10: five broken torchrun scripts; the learner names each bug and fixes it.

The scripts live in ``lib/dpcourse/scripts/lab10/`` (:func:`script` reads one, :func:`show`
prints it with line numbers and the multiple-choice options). Each trains the same tiny model
on the same tiny data for three epochs on every rank and saves rank 0's weights to ``--out``.
None of the five is a bug lesson 10 shows:

1. ``bug1_sampler.py`` — each rank's DistributedSampler has its own seed: the ranks take their
   slices of *different* permutations, so an epoch reads some examples twice, others never;
2. ``bug2_loader.py``  — the sampler is built but the loader shuffles by itself: every rank
   reads the whole data set, in the same order (the ranks duplicate each other);
3. ``bug3_clip.py``    — each rank clips its own gradient before the average: the replicas
   agree, but the clipped norm is a rank's, not the global batch's;
4. ``bug4_start.py``   — every rank broadcasts with ``src=rank``: each thinks it is the sender,
   nobody receives, and the run hangs before the first step;
5. ``bug5_mean.py``    — the loss is divided by the world size *and* the gradients are
   averaged: divided twice, every step world_size times too small.

:func:`check_answer` judges a multiple-choice answer and says why a wrong option is not it.
:func:`check_fixes` runs the fixed scripts under torchrun (all at once, for time), loads the
weights each one saved, and compares them with :func:`simulate`: the same training, every
rank's replica in this one process, done right. A data-parallel run done right equals it to
float tolerance; when a fix does not, :func:`simulate` replays each known mistake, and the
check names the one whose weights the script reproduced. Bug 5's fix runs on 3 ranks (a
``/ 2`` is right on 2 ranks only), every fix with ``--seed 3`` (a fix that hard-codes the seed
fails).

Stretch: :func:`check_replicas_in_sync` — the learner's detector for replicas that differ, run
on 3 ranks on equal replicas and on four ways to differ that a summary can miss (a
+1e-3/-1e-3 pair, a swap, a sign flip, only the last parameter), with a spy on ``all_reduce``
that names verdicts combined with MAX.
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
from dpcourse.checks import check_timeout, fail, passed, recorded, run_ranks, timed_out

__all__ = ["SCRIPTS", "CHOICES", "ANSWERS", "BUGS", "script", "show", "move_line", "check_answer",
           "simulate", "run_fix", "judge_fix", "check_fix", "check_fixes",
           "check_replicas_in_sync"]

SCRIPT_DIR = Path(__file__).resolve().parents[1] / "scripts" / "lab10"
SCRIPTS = {1: "bug1_sampler.py", 2: "bug2_loader.py", 3: "bug3_clip.py", 4: "bug4_start.py",
           5: "bug5_mean.py"}
SEED = 3  # the check's --seed: not the scripts' default, so a hard-coded seed shows
WORLD_SIZES = {1: 2, 2: 2, 3: 2, 4: 2, 5: 3}
CLIP = {3: 0.2}  # script 3 clips the gradient norm to this (after the average, when right)
TOL = 1e-5  # float drift measured at ~1e-7; every bug lands 1e-2 or more away

# bug -> [(option, why it is not the bug, or None for the right one)]
CHOICES = {
    1: [("A", "The ranks must shuffle in different orders, so each needs its own seed; the bug "
              "is that the model is seeded with args.seed on every rank.",
         "the replicas must start equal (one seed for the model), and DistributedSampler already "
         "gives each rank different examples: it cuts ONE shuffled order into slices."),
        ("B", "DistributedSampler cuts one shuffled order into per-rank slices; seeded "
              "differently, each rank slices a different order, so in an epoch some examples "
              "are read twice and others never.", None),
        ("C", "set_epoch must be called after the loop over the batches, not before.",
         "set_epoch before iterating is right: it reseeds the shuffle of the epoch about to "
         "start."),
        ("D", "The loss is not averaged over the ranks, only the gradients.",
         "the gradients are what the step uses, and they are averaged; the loss is only a "
         "number each rank backpropagates from.")],
    2: [("A", "DistributedSampler needs shuffle=True, or it deals the same order every epoch.",
         "shuffle=True is DistributedSampler's default."),
        ("B", "batch_size=4 must be divided by world_size: each rank should read 4 / "
              "world_size examples.",
         "batch_size is the per-rank batch: the global batch is 4 × world_size by design."),
        ("C", "The sampler is built but the loader never uses it (shuffle=True instead): every "
              "rank reads all 48 examples in the same order, so the ranks duplicate each "
              "other's work.", None),
        ("D", "set_epoch is called on the sampler instead of on the loader.",
         "set_epoch is a DistributedSampler method; the loader has none.")],
    3: [("A", "Each rank clips a different gradient, so the replicas drift apart.",
         "the clipped gradients are averaged afterwards, so every rank steps with the same "
         "gradient: the replicas agree. What is wrong is which norm was clipped."),
        ("B", "Gradient clipping cannot be combined with momentum.",
         "clipping bounds the gradient before the optimizer sees it; momentum works the same "
         "on clipped gradients."),
        ("C", "clip_grad_norm_ must come after opt.step().",
         "after the step the gradients have been used: clipping them then changes nothing."),
        ("D", "Each rank clips its own gradient before the average: the norm clipped is a "
              "rank's, not the global batch's, so the steps differ from training on the global "
              "batch (the replicas still agree).", None)],
    4: [("A", "Broadcasting p.data bypasses autograd, so the broadcast weights are lost.",
         "writing into p.data in place is how weights are broadcast; the values stay."),
        ("B", "Every rank passes its own rank as src: each thinks it is the sender, nobody "
              "receives, and every rank waits in the broadcast forever.", None),
        ("C", "The broadcast must come after the optimizer is created.",
         "the optimizer holds the same parameter tensors; broadcasting into them before or "
         "after creating it is the same."),
        ("D", "The gradients should be broadcast, not all-reduced.",
         "all-reducing and dividing is the average every rank needs; a broadcast would copy "
         "rank 0's gradient only.")],
    5: [("A", "all_reduce already averages, so the gradients are divided twice.",
         "dist.all_reduce sums by default (ReduceOp.SUM); the loop's division makes it an "
         "average — the second division is elsewhere."),
        ("B", "Dividing the loss by world_size makes each rank's loss its share of the global "
              "mean, which is right; the steps are too small because of momentum.",
         "momentum works as on one device when the gradients are right; they are not."),
        ("C", "The gradients are divided by world_size twice — once through the loss, once "
              "after the all_reduce: every step is world_size times too small.", None),
        ("D", "The loss must be all-reduced before backward so that every rank uses the "
              "global mean.",
         "all_reduce has no autograd rule: the gradient would not see it. Averaging the "
         "gradients once is the whole job.")],
}
ANSWERS = {n: next(o for o, _, why in opts if why is None) for n, opts in CHOICES.items()}

# variant name -> the sentence the learner reads when a "fixed" script reproduces that mistake
BUGS = {
    "sampler_seed_rank": "each rank's sampler still has its own seed: give DistributedSampler "
                         "the same seed (args.seed) on every rank.",
    "sampler_seed_ignored": "the sampler's seed no longer comes from --seed: seed it with "
                            "args.seed (the same on every rank), not with a number.",
    "no_sampler": "the loader still ignores the DistributedSampler: every rank reads every "
                  "example — pass sampler=sampler to the DataLoader (and no shuffle).",
    "clip_local": "each rank still clips its own gradient before the average: clip once the "
                  "gradients are averaged, just before opt.step().",
    "no_clip": "the gradients are no longer clipped at all: keep the clipping, after the "
               "average.",
    "divided_twice": "the gradients are still divided by world_size twice (once through the "
                     "loss, once after all_reduce): divide once.",
    "grad_sum": "the gradients are now summed, not averaged: divide by world_size exactly "
                "once, in the loss or after all_reduce.",
    "halved": "on 3 ranks the gradients were divided by 2: divide by world_size, not by a "
              "number true on 2 ranks only.",
}
# which mistakes each script's fix is compared with, when its weights are wrong
SUSPECTS = {1: ("sampler_seed_rank", "sampler_seed_ignored"), 2: ("no_sampler",),
            3: ("clip_local", "no_clip"), 4: (), 5: ("divided_twice", "grad_sum", "halved")}


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


def move_line(text: str, line: str, before: str) -> str:
    """``text`` with the one line that contains ``line`` moved to just before the one line that
    contains ``before``, re-indented like that line. Each must match exactly one line (a
    ``ValueError`` says how many matched otherwise), so no exact indentation or line ending
    needs typing: ``move_line(broken, "clip_grad_norm_", before="opt.step()")``."""
    lines = text.splitlines(keepends=True)

    def only(part, name):
        if not isinstance(part, str) or not part.strip():
            raise ValueError(f"{name} must be a non-empty piece of one line; got {part!r}")
        hits = [i for i, ln in enumerate(lines) if part in ln]
        if len(hits) != 1:
            raise ValueError(f"{name}={part!r} must match exactly one line; it matches "
                             f"{len(hits)}" + (f" (lines {[i + 1 for i in hits]})" if hits else ""))
        return hits[0]

    src, dst = only(line, "line"), only(before, "before")
    if src == dst:
        raise ValueError("line and before match the same line")
    moved = lines.pop(src)
    dst = dst - (src < dst)
    indent = lines[dst][:len(lines[dst]) - len(lines[dst].lstrip())]
    body = moved.strip("\r\n").lstrip()
    ending = moved[len(moved.rstrip("\r\n")):] or "\n"
    lines.insert(dst, indent + body + ending)
    return "".join(lines)


@recorded(name="check_answer {n}")
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


@functools.lru_cache(maxsize=64)
def _simulate(world_size: int, seed: int, variant: str, clip) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    known = ("correct", *BUGS)
    if variant not in known:
        raise ValueError(f"unknown variant {variant!r}: one of {known}")
    X, y = _data()
    ds = TensorDataset(X, y)
    if variant == "no_sampler":  # every rank reads everything, in the same order: one replica
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        loader = DataLoader(ds, batch_size=4, shuffle=True)
        for epoch in range(3):
            for xb, yb in loader:
                o.zero_grad()
                F.mse_loss(m(xb), yb).backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                o.step()
        return {k: v.detach().clone() for k, v in m.state_dict().items()}
    sampler_seed = {"sampler_seed_ignored": 0}.get(variant, seed)
    samplers = [DistributedSampler(ds, num_replicas=world_size, rank=r,
                                   seed=sampler_seed + (r if variant == "sampler_seed_rank" else 0))
                for r in range(world_size)]
    loaders = [DataLoader(ds, batch_size=4, sampler=s) for s in samplers]
    models, opts = [], []
    for r in range(world_size):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        models.append(m)
        opts.append(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    divide = {"grad_sum": 1, "halved": 2, "divided_twice": world_size ** 2}.get(variant,
                                                                                 world_size)
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        for batches in zip(*loaders):
            for m, o, (xb, yb) in zip(models, opts, batches):
                o.zero_grad()
                F.mse_loss(m(xb), yb).backward()
                if clip is not None and variant == "clip_local":
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            for ps in zip(*(m.parameters() for m in models)):
                total = ps[0].grad.clone()
                for p in ps[1:]:
                    total += p.grad
                for p in ps:
                    p.grad.copy_(total / divide)
            if clip is not None and variant not in ("clip_local", "no_clip"):
                for m in models:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            for o in opts:
                o.step()
    return {k: v.detach().clone() for k, v in models[0].state_dict().items()}


def simulate(world_size: int = 2, seed: int = SEED, variant: str = "correct",
             clip: float | None = None) -> dict:
    """Rank 0's final weights for the lab's training on ``world_size`` ranks, done right
    (``"correct"``) or with one of the mistakes in :data:`BUGS`, all replicas in this process;
    ``clip``: the gradient-norm clipping of script 3 (after the average when done right)."""
    return {k: v.clone() for k, v in _simulate(world_size, seed, variant, clip).items()}


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
                return hang
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
    ws, clip = WORLD_SIZES[n], CLIP.get(n)
    want = simulate(ws, clip=clip)
    d = _distance(weights, want)
    if d <= TOL:
        return
    for name in SUSPECTS[n]:
        if _distance(weights, simulate(ws, variant=name, clip=clip)) <= TOL:
            fail(f"Fix {n}: {BUGS[name]}")
    fail(f"Fix {n}: the final weights differ from a correct run on {ws} ranks by up to {d:.3g} "
         f"and match none of the mistakes the check knows: change only what the bug needs.")


@recorded(name="check_fix {n}")
def check_fix(n: int, text: str, timeout: float | None = None,
              launcher: str = "torchrun") -> None:
    """Run one fixed script under torchrun (``timeout``: 60 s, or ``DPCOURSE_CHECK_TIMEOUT`` if
    more) and compare its weights with the reference."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 60.0)
    _precheck(n, text)
    judge_fix(n, run_fix(n, text, timeout, launcher))
    passed(f"fix {n}: the weights equal a correct data-parallel run on {WORLD_SIZES[n]} ranks")


@recorded
def check_fixes(fixes: dict, timeout: float | None = None, launcher: str = "torchrun") -> None:
    """Run every fixed script under torchrun at the same time (a launch costs seconds) and
    judge each, in order (``timeout`` per script: 60 s, or ``DPCOURSE_CHECK_TIMEOUT`` if more)."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 60.0)
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

_CASES = ("same", "off_keeping_sum", "swapped", "sign_flipped", "last_param_off")
# what the learner reads when a detector calls differing replicas "in sync" in that case only
_BLIND = {
    "off_keeping_sum": "one weight +1e-3 and the next -1e-3",
    "swapped": "two weights swapped",
    "sign_flipped": "one weight's sign flipped",
    "last_param_off": "only the last parameter off by 1e-3",
}


def _detector_worker(rank, world_size, fn):
    __tracebackhide__ = True
    import torch
    import torch.distributed as dist

    from ..collectives import record_collectives

    results = {}

    def spy_all_reduce(call):
        # a MAX over one 0/1 number is a MAX over verdicts: "any rank says yes" wins
        tensor = call.args.get("tensor")
        if (call.function == "all_reduce"
                and call.args.get("op", dist.ReduceOp.SUM) == dist.ReduceOp.MAX
                and isinstance(tensor, torch.Tensor) and tensor.numel() == 1
                and float(tensor.reshape(-1)[0]) in (0.0, 1.0)):
            max_of_verdicts[0] = True

    for case in _CASES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 1))
        params = list(model.parameters())
        with torch.no_grad():
            first = params[0].view(-1)
            if rank == world_size - 1:
                if case == "off_keeping_sum":  # the sum of everything stays the same
                    first[0] += 1e-3
                    first[1] -= 1e-3
                if case == "swapped":          # sum, norm and sorted values stay the same
                    first[0], first[1] = first[1].clone(), first[0].clone()
                if case == "sign_flipped":     # the norm and the absolute values stay the same
                    first[2] = -first[2]
            if case == "last_param_off" and rank == 1:
                params[-1].view(-1)[0] += 1e-3
        before = [p.detach().clone() for p in params]
        max_of_verdicts = [False]
        with record_collectives(before=spy_all_reduce):
            verdict = fn(model)
        if isinstance(verdict, torch.Tensor) and verdict.numel() == 1:
            verdict = bool(verdict.item())
        changed = any(not torch.equal(b, p) for b, p in zip(before, params))
        results[case] = (verdict if isinstance(verdict, bool) else repr(verdict), changed,
                         max_of_verdicts[0])
    return results


@recorded
def check_replicas_in_sync(replicas_in_sync, world_size: int = 3,
                           timeout: float | None = None):
    """Stretch: on ``world_size`` ranks, ``replicas_in_sync(model)`` must return True on every
    rank when all replicas hold the same parameters, and False on every rank when one differs."""
    __tracebackhide__ = True
    from dpcourse.checks import has_todo

    timeout = check_timeout(timeout, 60.0)

    if not callable(replicas_in_sync):
        fail(f"replicas_in_sync must be a function, got {type(replicas_in_sync).__name__}.")
    if has_todo(replicas_in_sync):
        raise NotImplementedError("replicas_in_sync still has a TODO: write it, then run this "
                                  "check.")
    ranks = run_ranks(
        _detector_worker, world_size, replicas_in_sync, timeout=timeout,
        hang=lambda exc: f"replicas_in_sync did not return within {timeout:g} s on {world_size} "
                         f"ranks: does it call a collective on some ranks only?",
        failed=lambda exc: fail(f"replicas_in_sync raised on rank {exc.rank} of {world_size}: "
                                f"{exc.summary}"))
    blind = []
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
        if any(r[case][2] for r in ranks):
            fail(f"with {_BLIND[case]} on one rank, every rank returned True: you combined the "
                 f"verdicts with MAX, so one rank saying 'in sync' outvotes the rank that "
                 f"differs - combine them with MIN (any False must win).")
        blind.append(case)
    if blind:
        where = ", ".join(_BLIND[c] for c in blind)
        small = {"off_keeping_sum", "last_param_off"}
        if set(blind) == set(_BLIND):
            fail("whenever one replica differed, every rank returned True: the 'in sync' "
                 "verdict won — verdicts combined with any() or MAX, or rank 0's own verdict "
                 "sent to all (rank 0 compares with itself). Any rank's False must win: "
                 "all() of the gathered verdicts, or ReduceOp.MIN.")
        if small <= set(blind) and not set(blind) & {"swapped", "sign_flipped"}:
            why = ("each of those is a 1e-3 change and your tolerance let it pass; compare "
                   "exactly (torch.equal) or to a tiny tolerance")
        elif "off_keeping_sum" in blind:
            why = ("a plain sum or mean of the values cannot see that (lesson 10's checksum "
                   "weights each value by its position, and so can); compare every value")
        elif {"swapped", "sign_flipped"} <= set(blind):
            why = ("a norm (or another quantity that a swap and a sign flip keep) cannot see "
                   "that; compare every value, in place")
        elif "swapped" in blind:
            why = ("what you compare ignores where each value sits (sorted values, a histogram, "
                   "a sum of squares?); compare every value, in place")
        elif "sign_flipped" in blind:
            why = "what you compare ignores signs (absolute values?); compare every value"
        else:
            why = "compare every parameter on every rank, not just some"
        fail(f"the replicas differ ({where}) but replicas_in_sync returned True on every "
             f"rank: {why}.")
    passed(f"replicas_in_sync: True on all {world_size} ranks for equal replicas, False on all "
           f"of them when one replica differs")
