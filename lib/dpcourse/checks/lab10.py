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
   averaged: divided twice, every step world_size times too small. Its fix carries the lab's
   design decision, three answers :func:`check_decision` judges against the repair the fix
   made (:func:`kept_division`).

:func:`check_answer` judges a multiple-choice answer and says why a wrong option is not it.
:func:`check_fixes` runs the fixed scripts under torchrun (all at once, for time), loads the
weights each one saved, and compares them with :func:`simulate`: the same training, every
rank's replica in this one process, done right. A data-parallel run done right equals it to
float tolerance; when a fix does not, :func:`simulate` replays each known mistake, and the
check names the one whose weights the script reproduced. Bug 5's fix runs on 3 ranks (a
``/ 2`` is right on 2 ranks only), every fix with ``--seed 3`` (a fix that hard-codes the seed
fails).

Stretch: :func:`check_replicas_in_sync` — the learner's detector for replicas that differ, run
on 3 ranks on equal replicas and on ways to differ that a summary or a tolerance can miss (a
+1e-3/-1e-3 pair, a position-weighted pair, a swap, a sign flip, only the last parameter, one
unit in the last place, +0.0 against -0.0), with a spy on ``all_reduce`` that names verdicts
combined with MAX. "Exactly equal" is the same bits: the same NaN on every replica is in sync.
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
from dpcourse.checks import (check_timeout, fail, passed, recorded, reveal, run_ranks,
                             timed_out)

__all__ = ["SCRIPTS", "CHOICES", "ANSWERS", "BUGS", "BUG_LINES", "EFFECTS", "script", "show",
           "options",
           "bug_lines", "check_line", "move_line", "check_answer", "simulate", "run_fix",
           "judge_fix", "check_fix", "check_fixes", "examples_read", "check_prediction",
           "check_replicas_in_sync", "kept_division", "check_decision", "KEPT",
           "LOSS_HOLDS", "UNDER_DDP"]

SCRIPT_DIR = Path(__file__).resolve().parents[1] / "scripts" / "lab10"
SCRIPTS = {1: "bug1_sampler.py", 2: "bug2_loader.py", 3: "bug3_clip.py", 4: "bug4_start.py",
           5: "bug5_mean.py"}
SEED = 3  # the check's --seed: not the scripts' default, so a hard-coded seed shows
WORLD_SIZES = {1: 2, 2: 2, 3: 2, 4: 2, 5: 3}
CLIP = {3: 0.2}  # script 3 clips the gradient norm to this (after the average, when right)
TOL = 1e-5  # float drift measured at ~1e-7; every bug lands 1e-2 or more away

# bug -> [(option, why it is not the bug, or None for the right one)]. The options are alike in
# length and form (tests/test_lab10_checks.py holds them to it), and a wrong option's sentence
# says why that option is wrong without naming the right one: the learner has already found the
# line (check_line) and now says what is wrong with it.
CHOICES = {
    1: [("A", "Every rank seeds its model with args.seed, so the replicas cannot explore "
              "different initial weights.",
         "the replicas must start equal — data parallelism is one model trained on a larger "
         "batch — so one seed (or a broadcast) for the weights is right."),
        ("B", "Each rank's sampler shuffles its own permutation, so one epoch reads some "
              "examples twice and others never.", None),
        ("C", "set_epoch runs before the loop over the batches; it must run after it, once "
              "the epoch's batches are read.",
         "set_epoch reseeds the shuffle of the epoch about to start, so it belongs before the "
         "loop, where it is."),
        ("D", "Only the gradients are averaged over the ranks; the loss must be averaged too, "
              "before backward runs.",
         "the step uses the gradients, and they are averaged; each rank's loss is only where "
         "its backward starts.")],
    2: [("A", "The DistributedSampler is built without shuffle=True, so it deals the same "
              "order of examples in every epoch.",
         "shuffle=True is DistributedSampler's default, and set_epoch gives each epoch its own "
         "order."),
        ("B", "batch_size=4 is the global batch, so each rank should load 4 / world_size "
              "examples per step.",
         "a DataLoader's batch_size is per rank: the global batch is 4 × world_size by design, "
         "and nothing here assumes otherwise."),
        ("C", "The loader never draws from the sampler, so every rank reads all 48 examples "
              "each epoch.", None),
        ("D", "set_epoch is called on the sampler, but the loader is what must be told which "
              "epoch starts.",
         "set_epoch is a DistributedSampler method; a DataLoader has no set_epoch at "
         "all.")],
    3: [("A", "Each rank clips a different gradient, so the replicas' weights drift apart "
              "from the first step on.",
         "after the clipping line the gradients are all-reduced and divided, so every rank "
         "applies the same gradient and the replicas stay equal."),
        ("B", "Gradient-norm clipping interferes with SGD's momentum, so it must not be used "
              "with this optimizer.",
         "clipping bounds the gradient before the optimizer sees it; momentum accumulates "
         "clipped gradients as it would any others."),
        ("C", "clip_grad_norm_ must run after opt.step(), once the step has used the gradients "
              "it is meant to bound.",
         "after the step the gradients have been used: clipping them then changes nothing in "
         "the weights."),
        ("D", "Each rank bounds its own gradient's norm, which differs from bounding the norm "
              "of the averaged gradient.", None)],
    4: [("A", "Broadcasting into p.data bypasses autograd, so the received weights are lost at "
              "the first backward.",
         "writing into p.data in place is how initial weights are broadcast; the values stay, "
         "and autograd plays no part before the first forward."),
        ("B", "Each rank names itself as the sender, so no rank receives and the broadcast "
              "cannot complete.", None),
        ("C", "The broadcast must come after the optimizer is built, or the optimizer keeps "
              "the weights from before it.",
         "the optimizer holds the same parameter tensors, which the broadcast writes into in "
         "place: before or after is the same."),
        ("D", "The gradients should be broadcast from one rank instead of being all-reduced by "
              "every rank.",
         "all-reducing then dividing gives every rank the average it needs; a broadcast would "
         "copy one rank's gradient and waste the others'.")],
    5: [("A", "dist.all_reduce averages by default, so the division after it divides the "
              "gradients a second time.",
         "dist.all_reduce sums by default (ReduceOp.SUM): what it hands back is the sum of the "
         "ranks' tensors."),
        ("B", "Dividing the loss by world_size is right; the steps are too small only because "
              "momentum damps them.",
         "momentum behaves as on one device when the gradients are right, and then the steps "
         "are right too."),
        ("C", "The gradients are divided by world_size twice, once through the loss and once "
              "after the all-reduce.", None),
        ("D", "The loss must be all-reduced before backward, so that every rank backpropagates "
              "from the global mean.",
         "all_reduce has no autograd rule, so the backward would not see it: each rank's "
         "gradient would still be its own.")],
}
ANSWERS = {n: next(o for o, _, why in opts if why is None) for n, opts in CHOICES.items()}

# variant name -> (the cause the learner reads when a "fixed" script reproduces that mistake,
# what to change: added only when the same mistake comes back, checks.fail's fix=)
BUGS = {
    "sampler_seed_rank": ("each rank's sampler still has its own seed, so the ranks still take "
                          "their slices of different permutations.",
                          "Give DistributedSampler the same seed (args.seed) on every rank."),
    "sampler_seed_ignored": ("the sampler's seed no longer comes from --seed: the check ran the "
                             "script with --seed 3, and the sampler shuffled as if it were 0.",
                             "Seed it with args.seed (the same on every rank), not a number."),
    "no_sampler": ("the loader still ignores the DistributedSampler: every rank reads every "
                   "example, so the ranks duplicate each other's work.",
                   "Pass sampler=sampler to the DataLoader, and no shuffle."),
    "no_sampler_in_order": ("the loader still ignores the DistributedSampler (without shuffle "
                            "it now reads the data in order): every rank reads every example.",
                            "The loader must draw from the sampler (sampler=sampler)."),
    "clip_local": ("each rank still clips its own gradient before the average, so the norm "
                   "clipped is one rank's, not the global batch's.",
                   "Clip once the gradients are averaged, just before opt.step()."),
    "no_clip": ("the gradients are no longer clipped at all: the weights match a run without "
                "clipping.", "Keep the clipping, after the average."),
    "no_broadcast": ("the replicas no longer start from the same weights: each rank keeps what "
                     "its own seed drew, so their averaged gradients step different models.",
                     "Keep the broadcast, with one sender named on every rank."),
    "divided_twice": ("the gradients are still divided by world_size twice (once through the "
                      "loss, once after all_reduce): every step is world_size times too "
                      "small.", "Divide once."),
    "grad_sum": ("the gradients are now summed, not averaged: every step is world_size times "
                 "too large.", "Divide by world_size exactly once, in the loss or after "
                                "all_reduce."),
    "halved": ("on 3 ranks the gradients were divided by 2, a number true on 2 ranks only.",
               "Divide by world_size."),
}
# which mistakes each script's fix is compared with, when its weights are wrong
SUSPECTS = {1: ("sampler_seed_rank", "sampler_seed_ignored"),
            2: ("no_sampler", "no_sampler_in_order"),
            3: ("clip_local", "no_clip"), 4: ("no_broadcast",),
            5: ("divided_twice", "grad_sum", "halved")}

# bug -> pieces of the lines where the bug is (check_line accepts any line holding one)
BUG_LINES = {1: ("DistributedSampler(dataset",), 2: ("loader = DataLoader(",),
             3: ("clip_grad_norm_",), 4: ("dist.broadcast(",),
             5: ("/ world_size  #", "p.grad /= world_size")}
# bug -> the other side of a bug that is an ORDER of two lines: bug 3 is the clip running
# before the average, so the average's lines are a right answer too (moving the all-reduce
# above the clip is as good a repair as moving the clip down)
ORDER_LINES = {3: ("# average the gradients", "dist.all_reduce(p.grad)", "p.grad /= world_size")}
# bug -> (the question about what the script does, answered by a number worked out from its
# own lines; the answer; the tolerance; how to work it out: fail's fix=, on the second
# meeting). The number is judged before the line, so a line found by trying candidates is not
# confirmed without the fact that makes it the bug. None of these numbers is in a lesson:
# each is this script's, with the check's values (--seed 3; 2 ranks, bug 5's 3).
EFFECTS = {
    1: ("with the check's --seed 3 on 2 ranks, the sum of the three seeds rank 1 uses: the "
        "data's generator, the sampler's and torch.manual_seed's", 1241, 0,
        "Read each line that seeds something with args.seed = 3 and rank = 1, and add the "
        "three seeds."),
    2: ("on 2 ranks, how many examples rank 1 reads in one epoch (the data set has 48)", 48, 0,
        "Follow the examples from the data set to the batches of the loop: which object hands "
        "rank 1 its batches, and from which examples?"),
    3: ("with Hint 2's gradients g₀ = (3, 0) on rank 0 and g₁ = (0, 1) on rank 1, and "
        "max_norm = 1, the first component of the gradient this script's opt.step() uses", 0.5,
        0.01, "Apply the script's lines in their order to (3, 0) and (0, 1): first what each "
              "rank does alone, then the sum and the division."),
    4: ("on 2 ranks, how many ranks receive a tensor in the first dist.broadcast", 0, 0,
        "For each rank, read the src it passes: a rank that names itself as src sends."),
    5: ("on 3 ranks, how many times smaller the gradient opt.step() uses is than the gradient "
        "of one device's mean loss over the global batch (3 if a third, 1 if the same)", 3,
        0.01, "Follow one gradient from the loss to opt.step() and count every division by "
              "world_size on the way, and what the all_reduce's sum does."),
}
# bug -> the question a learner who picked another line is sent back with (never the answer)
LOOK_AGAIN = {
    1: "ask which examples each rank's loader yields in one epoch, and whether the ranks "
       "together read the data set exactly once",
    2: "ask which examples each rank reads in one epoch, and which object decides that",
    3: "ask, for each line of the step, whether it sees this rank's own gradient or the "
       "average over the ranks",
    4: "ask what each rank does in the first collective it calls, and which rank sends",
    5: "follow one gradient from the loss to opt.step() and count what it is divided by",
}
# bug -> what a learner who has tried lines one by one is asked to predict of the next line
# (fail's fix=: it joins the sentence from the second wrong line for the same bug on)
EFFECT = {
    1: "which examples each rank then reads in one epoch",
    2: "which examples each rank then reads, and in which order",
    3: "which gradient it then changes, and whether one device would change the same one",
    4: "what each rank then does in that call, and which rank receives",
    5: "what each gradient is then divided by, counted all the way to opt.step()",
}


def script(n: int) -> str:
    """The text of broken script ``n`` (1 to 5)."""
    if n not in SCRIPTS:
        raise ValueError(f"there are five scripts, 1 to 5; got {n!r}")
    return (SCRIPT_DIR / SCRIPTS[n]).read_text()


def show(n: int) -> None:
    """Print script ``n`` with line numbers (the options come after :func:`check_line`)."""
    print(f"--- {SCRIPTS[n]} ---")
    for i, line in enumerate(script(n).splitlines(), 1):
        print(f"{i:3d}  {line}")


def options(n: int) -> None:
    """Print the four options for bug ``n``."""
    if n not in CHOICES:
        raise ValueError(f"there are five bugs, 1 to 5; got {n!r}")
    print(f"What is wrong in {SCRIPTS[n]}?")
    for option, text, _ in CHOICES[n]:
        print(f"  {option}. {text}")


def bug_lines(n: int) -> list[int]:
    """The line numbers (as :func:`show` prints them) where bug ``n`` is."""
    return [i for i, line in enumerate(script(n).splitlines(), 1)
            if any(piece in line for piece in BUG_LINES[n])]


def _is_number(value) -> bool:
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@recorded(name="check_line {n}")
def check_line(n: int, line, effect) -> None:
    """The learner's own diagnosis of bug ``n``, before any option: ``line`` is the number of
    the line (as :func:`show` prints it) where the bug is, ``effect`` the number that answers
    the bug's question about what the script does (:data:`EFFECTS`), worked out from its lines.
    ``effect`` is judged first: a wrong number leaves the line unjudged, so trying line numbers
    confirms nothing. A right line then prints the options for :func:`check_answer`; a wrong
    one is sent back with a question, and from the second wrong line for the same bug on, with
    a request to work out the line's effect first."""
    __tracebackhide__ = True
    if n not in SCRIPTS:
        raise ValueError(f"there are five bugs, 1 to 5; got {n!r}")
    if line is None or line is Ellipsis or effect is None or effect is Ellipsis:
        raise NotImplementedError(f"write line{n} and effect{n} first, then run this check.")
    lines = script(n).splitlines()
    if isinstance(line, bool) or not isinstance(line, int) or not 1 <= line <= len(lines):
        fail(f"line{n} should be one line number of {SCRIPTS[n]}, 1 to {len(lines)} as the "
             f"listing numbers them; got {line!r}.")
    question, answer, tol, how = EFFECTS[n]
    if not _is_number(effect) or effect != effect:
        fail(f"effect{n} should be a number ({question}); got {effect!r}.")
    # the fact first: a line is neither confirmed nor refused for a wrong number, so trying
    # line numbers with any number finds nothing
    if abs(float(effect) - answer) > tol:
        fail(f"effect{n} = {effect!r} is not what {SCRIPTS[n]} does ({question}), so line "
             f"{line} is not judged: {LOOK_AGAIN[n]}, and work the number out on the script's "
             f"own lines.", fix=how)
    code = lines[line - 1].strip() or "(a blank line)"
    if any(piece in lines[line - 1] for piece in ORDER_LINES.get(n, ())):
        passed(f"bug {n} is the order of two lines, and line {line} is one side of it: the "
               f"average comes after the clip (moving the all-reduce above the clip repairs it "
               f"too). The options speak of the other side, line {bug_lines(n)[0]}: the clip, "
               f"which runs on this rank's own gradient. Now set answer{n}.")
        options(n)
        return
    if line not in bug_lines(n):
        fail(f"Line {line} (`{code}`) is not where bug {n} is: it does here what it would do in "
             f"a correct script. To find the line, {LOOK_AGAIN[n]}.",
             fix=f"Trying lines one by one finds a line, not the reason. Before the next one, "
                 f"read the line you suspect and work out what it does to the run — "
                 f"{EFFECT[n]} — and try it only if that differs from one device training on "
                 f"the global batch.")
    passed(f"bug {n} is on line {line} (effect{n} = {effect:g}). Now say what is wrong there: "
           f"set answer{n} to the option that says it.")
    options(n)


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
def _simulate(world_size: int, seed: int, variant: str, clip, init_from: int = 0) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    known = ("correct", *BUGS)
    if variant not in known:
        raise ValueError(f"unknown variant {variant!r}: one of {known}")
    X, y = _data()
    ds = TensorDataset(X, y)
    if variant in ("no_sampler", "no_sampler_in_order"):
        # every rank reads everything, in the same order: the ranks are one replica
        torch.manual_seed(seed + init_from)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        loader = DataLoader(ds, batch_size=4, shuffle=variant == "no_sampler")
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
        # every replica starts from rank init_from's weights (a broadcast from it), or, with no
        # broadcast, from what its own seed drew
        torch.manual_seed(seed + (r if variant == "no_broadcast" else init_from))
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
             clip: float | None = None, init_from: int = 0) -> dict:
    """Rank 0's final weights for the lab's training on ``world_size`` ranks, done right
    (``"correct"``) or with one of the mistakes in :data:`BUGS`, all replicas in this process;
    ``clip``: the gradient-norm clipping of script 3 (after the average when done right);
    ``init_from``: the rank whose initial weights (``seed + init_from``) every replica starts
    from — script 4 seeds each rank differently and broadcasts one rank's weights."""
    return {k: v.clone() for k, v in _simulate(world_size, seed, variant, clip,
                                               init_from).items()}


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
    _read_fix(n, text)


def _lines_with(text: str, piece: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if piece in ln and not
            ln.strip().startswith("#")]


def _read_fix(n: int, text: str) -> None:
    """Mistakes a fix shows in its text, said before any launch — the ones whose weights alone
    cannot tell (a learning rate that makes up for a gradient, clipping that changes nothing)."""
    __tracebackhide__ = True
    if n == 1:
        for line in _lines_with(text, "DistributedSampler("):
            seed = re.search(r"seed\s*=\s*([^,)]*)", line)
            if seed and re.search(r"\brank\b", seed.group(1)):
                cause, fix = BUGS["sampler_seed_rank"]
                fail(f"Fix 1: {cause} (its seed is `{seed.group(1).strip()}`)", fix=fix)
    if n == 3:
        lines = text.splitlines()
        clip = [i for i, ln in enumerate(lines) if "clip_grad_norm_" in ln]
        step = [i for i, ln in enumerate(lines) if "opt.step()" in ln]
        if clip and step and min(clip) > max(step):
            fail("Fix 3: clip_grad_norm_ now runs after opt.step(): the step has already used "
                 "the gradients, so clipping them afterwards changes no weight.")
    if n == 4:
        for line in _lines_with(text, "dist.broadcast("):
            if re.search(r"src\s*=\s*rank\b", line):
                fail("Fix 4: the broadcast still names src=rank: every rank names itself as "
                     "the one that sends, so no rank receives.",
                     fix="A rooted collective needs the same root on every rank.")
    if n == 5 and _lines_with(text, "lr") != _lines_with(script(5), "lr"):
        fail("Fix 5: you changed the learning rate to make up for the gradients: they are "
             "still divided by world_size twice, and a larger lr undoes that for SGD only — "
             "Adam, weight decay or clipping would see gradients world_size times too small.",
             fix="Keep the learning rate and divide once.")


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


def kept_division(text: str) -> str | None:
    """Which of bug 5's two divisions by world_size a fixed script kept: ``"loss"``,
    ``"gradient"``, or None when its code divides neither by world_size (or both)."""
    code = [ln.split("#", 1)[0] for ln in text.splitlines()]
    loss = any("world_size" in c and ("mse_loss" in c or c.strip().startswith("loss"))
               for c in code)
    grad = any("world_size" in c and "grad" in c for c in code)
    return {(True, False): "loss", (False, True): "gradient"}.get((loss, grad))


# bug 5's design decision, answered in three words the check judges against the repair the
# fixed script made (kept_division reads it from the code, comments aside). What `loss` holds
# on a rank after the fix, and what else changes when the loop moves to DDP (which averages
# the gradients over the ranks, dividing by world_size itself: torch/nn/parallel/
# distributed.py, divide_by_initial_world_size; so the hand-written all_reduce loop goes):
KEPT = ("loss", "gradients")
LOSS_HOLDS = ("this rank's mean", "this rank's mean / world_size", "the global mean")
UNDER_DDP = ("nothing else", "remove the loss's / world_size", "add / world_size to the loss")
_RIGHT = {"loss": ("this rank's mean / world_size", "remove the loss's / world_size"),
          "gradients": ("this rank's mean", "nothing else")}
_NO_COLLECTIVE = ("each rank computes `loss` from its own batch only, and no collective runs "
                  "before backward: the all_reduce acts on the gradients, after backward, so "
                  "no rank's `loss` ever sees another rank's examples")
# (the repair kept, the wrong answer) -> the cause: why that reasoning does not hold
_LOSS_CAUSE = {
    ("gradients", "this rank's mean / world_size"):
        "your fixed5 no longer divides the loss by world_size: the line that computes `loss` "
        "divides by nothing, so no world_size is left in it",
    ("gradients", "the global mean"): _NO_COLLECTIVE,
    ("loss", "this rank's mean"):
        "your fixed5 still divides by world_size on the line that computes `loss`: the number "
        "it holds is not the mean F.mse_loss returned",
    ("loss", "the global mean"): _NO_COLLECTIVE + " (dividing a rank's own number by "
                                                  "world_size does not bring them in)",
}
_DDP_CAUSE = {
    ("gradients", "remove the loss's / world_size"):
        "your fixed5 already removed the loss's / world_size: there is none left to remove",
    ("gradients", "add / world_size to the loss"):
        "DDP averages the gradients over the ranks, dividing by world_size itself: a "
        "loss divided by world_size as well makes every gradient world_size times too small, "
        "bug 5 again under DDP",
    ("loss", "nothing else"):
        "your loss is divided by world_size and DDP averages the gradients, dividing by "
        "world_size again: once the hand-written loop (the sum) is gone, every gradient is "
        "world_size times too small, bug 5 again under DDP",
    ("loss", "add / world_size to the loss"):
        "your loss is already divided by world_size and DDP divides the gradients by "
        "world_size again: one more division makes every gradient world_size² times too small",
}


@recorded
def check_decision(fixed5: str, kept, loss_holds, under_ddp) -> None:
    """Bug 5's design decision, judged against the repair ``fixed5`` made: which division it
    ``kept`` (one of :data:`KEPT`), what ``loss`` holds on a rank afterwards (one of
    :data:`LOSS_HOLDS`), and what else changes when the loop moves to DDP and its hand-written
    all_reduce loop goes (one of :data:`UNDER_DDP`)."""
    __tracebackhide__ = True
    if not isinstance(fixed5, str):
        fail(f"Pass fixed5, your fixed script's text (a str), not {type(fixed5).__name__}.")
    for name, value, allowed in (("kept", kept, KEPT), ("loss_holds", loss_holds, LOSS_HOLDS),
                                 ("under_ddp", under_ddp, UNDER_DDP)):
        if value not in allowed:
            fail(f"{name} is {value!r}: it must be one of "
                 f"{', '.join(repr(a) for a in allowed)}, written exactly so.")
    code = {"loss": "loss", "gradient": "gradients"}.get(kept_division(fixed5))
    if code is None:
        fail("Decision 5: your fixed5 divides by world_size in both places or in neither, so "
             "it keeps no single division to decide about.",
             fix="Fix bug 5 first (lab10.check_fix(5, fixed5)), then answer for that fix.")
    if kept != code:
        said = {"loss": "the line that computes `loss` divides by world_size and the "
                        "gradients are not divided after all_reduce",
                "gradients": "the gradients are divided by world_size after all_reduce and "
                             "the line that computes `loss` divides by nothing"}[code]
        fail(f"Decision 5: kept = {kept!r}, but in your fixed5 {said}.",
             fix=f"Answer for the repair your fixed5 makes: kept = {code!r} (or change fixed5).")
    holds, ddp = _RIGHT[code]
    if loss_holds != holds:
        fail(f"Decision 5: loss_holds = {loss_holds!r}, but {_LOSS_CAUSE[code, loss_holds]}.",
             fix=f"loss_holds = {holds!r}.")
    if under_ddp != ddp:
        fail(f"Decision 5: under_ddp = {under_ddp!r}, but {_DDP_CAUSE[code, under_ddp]}.",
             fix=f"under_ddp = {ddp!r}.")
    passed({"loss": "decision 5: kept the loss's division; `loss` holds this rank's mean / "
                    "world_size, and under DDP that division goes with the hand-written loop",
            "gradients": "decision 5: kept the gradients' division, the one DDP does; "
                         "`loss` holds this rank's own mean, and under DDP nothing else "
                         "changes"}[code])


def judge_fix(n: int, weights) -> None:
    """Nothing if ``weights`` (or the sentence :func:`run_fix` returned) are right for bug
    ``n``; else fail naming the bug the weights reproduce."""
    __tracebackhide__ = True
    if isinstance(weights, str):
        fail(f"Fix {n}: {weights}")
    ws, clip = WORLD_SIZES[n], CLIP.get(n)
    # script 4 seeds every rank differently: a right fix starts every replica from one rank's
    # weights, whichever rank sends them
    senders = range(ws) if n == 4 else (0,)
    d = min(_distance(weights, simulate(ws, clip=clip, init_from=s)) for s in senders)
    if d <= TOL:
        return
    for name in SUSPECTS[n]:
        if _distance(weights, simulate(ws, variant=name, clip=clip)) <= TOL:
            cause, fix = BUGS[name]
            fail(f"Fix {n}: {cause}", fix=fix)
    fail(f"Fix {n}: the final weights differ from a correct run on {ws} ranks by up to {d:.3g} "
         f"and match none of the mistakes the check knows.",
         fix="Change only what the bug needs.")


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


# --- a prediction: what script 1 does to one epoch ------------------------------------------


def examples_read(world_size: int = 2, seed: int = SEED, epoch: int = 0) -> int:
    """How many of the 48 examples the ranks of script 1 read, together, in one epoch: each
    rank's DistributedSampler seeded ``seed + rank`` as the script does, each rank's slice of
    its own permutation collected, the distinct indices counted. (A right script reads 48.)"""
    import torch
    from torch.utils.data import DistributedSampler

    dataset = torch.arange(48)
    read = set()
    for r in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=r, seed=seed + r)
        sampler.set_epoch(epoch)
        read.update(sampler)
    return len(read)


def check_prediction(guess) -> None:
    """Compare the learner's prediction of :func:`examples_read` for script 1 (two ranks, one
    epoch) with the count, and say where the count comes from."""
    __tracebackhide__ = True
    measured = examples_read()
    expected = 48 - 48 // 4
    reveal(guess, measured, close=isinstance(guess.value, (int, float))
           and abs(guess.value - measured) <= 6,
           explanation=f"Each rank reads its half of its own permutation, so an example is in "
                       f"rank 0's half with probability 1/2 and, independently, in rank 1's "
                       f"with 1/2: about a quarter of the data (12) is read by neither rank and "
                       f"a quarter by both, so about {expected} distinct examples per epoch — "
                       f"this run read {measured}. One shared seed cuts ONE permutation into "
                       f"disjoint halves: all 48, each once.")


# --- stretch: a detector for bug 1 ---------------------------------------------------------

_CASES = ("same", "off_keeping_sum", "off_keeping_weighted_sum", "swapped", "sign_flipped",
          "last_param_off", "one_ulp", "signed_zero", "same_nan")
# the cases whose replicas are in sync: "exactly equal" is the lab's rule, the same bits, so the
# same NaN at the same place on every replica is in sync (a NaN is not equal to itself as a
# value, but its bits are the same), and +0.0 against -0.0 is not (equal values, other bits)
_IN_SYNC = ("same", "same_nan")
# what the learner reads when a detector calls differing replicas "in sync" in that case only
_BLIND = {
    "off_keeping_sum": "one weight +1e-3 and the next -1e-3",
    "off_keeping_weighted_sum": "one weight +2⁻⁹ and the next −2⁻¹⁰",
    "swapped": "two weights swapped",
    "sign_flipped": "one weight's sign flipped",
    "last_param_off": "only the last parameter off by 1e-3",
    "one_ulp": "one weight one unit in the last place away (torch.nextafter)",
    "signed_zero": "one weight +0.0 on the other ranks and −0.0 on one",
}


def _detector_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


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
        model = _detector_model()
        params = list(model.parameters())
        with torch.no_grad():
            first = params[0].view(-1)
            if case == "off_keeping_weighted_sum":  # exact binary values on every rank
                first[0], first[1] = 0.25, 0.5
            if rank == world_size - 1:
                if case == "off_keeping_weighted_sum":
                    # +2δ at position 1 and −δ at position 2: a sum weighted 1, 2, 3, … (lesson
                    # 10's checksum) stays exactly the same; a plain sum does not
                    first[0] += 2.0 ** -9
                    first[1] -= 2.0 ** -10
                if case == "off_keeping_sum":  # the sum of everything stays the same
                    first[0] += 1e-3
                    first[1] -= 1e-3
                if case == "swapped":          # sum, norm and sorted values stay the same
                    first[0], first[1] = first[1].clone(), first[0].clone()
                if case == "sign_flipped":     # the norm and the absolute values stay the same
                    first[2] = -first[2]
            if case == "last_param_off" and rank == 1:
                params[-1].view(-1)[0] += 1e-3
            if case == "one_ulp" and rank == world_size - 1:  # the next float32 up
                first[3] = torch.nextafter(first[3], torch.tensor(float("inf")))
            if case == "signed_zero":                 # equal as values, not as bits
                first[5] = -0.0 if rank == world_size - 1 else 0.0
            if case == "same_nan":                    # the same bits on every rank
                first[4] = float("nan")
        before = [p.detach().clone() for p in params]
        max_of_verdicts = [False]
        with record_collectives(before=spy_all_reduce) as calls:
            verdict = fn(model)
        # the most numbers any one collective carried in or out: a rank that never received
        # more than a verdict per rank compared its weights with nothing but its own
        carried = max((max(c.numel, c.out_numel) if c.dtype is not None else
                       max(c.nbytes, c.out_nbytes) // 8 for c in calls), default=0)
        if isinstance(verdict, torch.Tensor) and verdict.numel() == 1:
            verdict = bool(verdict.item())
        # bit for bit: a NaN kept in place is not a change, a +0.0 made -0.0 is
        changed = any(not torch.equal(b.reshape(-1).view(torch.uint8),
                                      p.detach().reshape(-1).view(torch.uint8))
                      for b, p in zip(before, params))
        results[case] = (verdict if isinstance(verdict, bool) else repr(verdict), changed,
                         max_of_verdicts[0], carried)
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
    blind, nan_refused = [], None
    for case in _CASES:
        verdicts = [r[case][0] for r in ranks]
        if any(r[case][1] for r in ranks):
            fail("replicas_in_sync changed the model's parameters: a detector that repairs what "
                 "it inspects hides the very difference it should report.",
                 fix="Only compare: broadcast or gather copies, never into the parameters.")
        bad = [v for v in verdicts if not isinstance(v, bool)]
        if bad:
            fail(f"replicas_in_sync should return True or False, got {bad[0]}.")
        want = case in _IN_SYNC
        wrong = [r for r, v in enumerate(verdicts) if v != want]
        if not wrong:
            continue
        if len(set(verdicts)) > 1:
            fail(f"the ranks disagree (verdicts {verdicts} on ranks 0 to {world_size - 1}, "
                 f"when the replicas are {'equal' if want else 'not'}): each rank answered "
                 f"from what it alone saw.",
                 fix="Every rank must return the same verdict: combine them with a collective.")
        if case == "same_nan":  # said after the blind spots: a value comparison has both
            nan_refused = wrong[0]
            continue
        if want:
            fail(f"with every replica identical, replicas_in_sync returned False on rank "
                 f"{wrong[0]}: it saw a difference where there is none.",
                 fix="Compare the bits of the values, every one of them.")
        if any(r[case][2] for r in ranks):
            fail(f"with {_BLIND[case]} on one rank, every rank returned True: you combined the "
                 f"verdicts with MAX, so one rank saying 'in sync' outvotes the rank that "
                 f"differs.", fix="Combine them so that any False wins (MIN).")
        blind.append(case)
    nan_said = (" And with the same NaN at the same place on every replica (the same bits) it "
                "returned False: a NaN never equals itself as a value." if nan_refused is not None
                else "")
    if blind:
        where = ", ".join(_BLIND[c] for c in blind)
        carried = max(r[c][3] for r in ranks for c in blind)
        if set(blind) == set(_BLIND) and carried <= world_size:
            numel = sum(p.numel() for p in _detector_model().parameters())
            fail(f"whenever one replica differed, every rank returned True, and no collective "
                 f"carried more than {carried} number{'s' * (carried != 1)} (a verdict per "
                 f"rank at most; the model has {numel} parameters): no rank ever received another rank's weights, so each compared "
                 f"its weights with a copy of its own and found them equal.",
                 fix="Every rank must compare its own weights with the same reference copy, "
                     "one rank's, received from it by a collective.")
        if set(blind) == set(_BLIND):
            fail("whenever one replica differed, every rank returned True: the 'in sync' "
                 "verdict won — verdicts combined with any() or MAX, or rank 0's own verdict "
                 "sent to all (rank 0 compares with itself).",
                 fix="Any rank's False must win: all() of the gathered verdicts, or "
                     "ReduceOp.MIN.")
        fix = "Compare every value, in place."
        tolerance = {"off_keeping_sum", "off_keeping_weighted_sum", "last_param_off", "one_ulp",
                     "signed_zero"}
        if "one_ulp" in blind and set(blind) <= tolerance and (
                "last_param_off" in blind or "off_keeping_sum" not in blind):
            why = ("your comparison has a tolerance (allclose, isclose, a difference below some "
                   "size), and it let that pass; the lab's 'exactly equal' is the same bits, "
                   "and a replica one float away from the others is out of sync")
            fix = "Compare exactly: the same bits, no tolerance."
        elif set(blind) == {"signed_zero"}:
            why = ("you compare values (torch.equal, ==), and −0.0 == +0.0 as a value; the lab's "
                   "'exactly equal' is the same bits, and these differ in the sign bit"
                   + ("." + nan_said.rstrip(".") if nan_said else ""))
            fix = ("Compare the bits: view each parameter as integers of its size "
                   "(tensor.view(torch.int32) for float32) before comparing.")
        elif "off_keeping_sum" in blind:
            why = "a plain sum or mean of the values cannot see that"
        elif "off_keeping_weighted_sum" in blind:
            why = ("a sum that weights each value by its position (lesson 10's checksum) cannot "
                   "see +2δ at one position with −δ at the next: any one number summarizing "
                   "the weights has such blind spots, and the lab asks for False whenever a "
                   "replica differs anywhere")
        elif {"swapped", "sign_flipped"} <= set(blind):
            why = "a norm (or another quantity that a swap and a sign flip keep) cannot see that"
        elif "swapped" in blind:
            why = ("what you compare ignores where each value sits (sorted values, a histogram, "
                   "a sum of squares?)")
        elif "sign_flipped" in blind:
            why = "what you compare ignores signs (absolute values?)"
        else:
            why = "the parameter that differed is one your detector does not compare"
            fix = "Compare every parameter on every rank, not just some."
        fail(f"the replicas differ ({where}) but replicas_in_sync returned True on every "
             f"rank: {why}.", fix=fix)
    if nan_refused is not None:
        fail(f"every replica holds the same NaN at the same place (the same bits: in sync, by "
             f"the lab's rule), and replicas_in_sync returned False on rank {nan_refused}: you "
             f"compare values, and a NaN never equals itself as a value.",
             fix="Compare the bits: view each parameter as integers of its size "
                 "(tensor.view(torch.int32) for float32) before comparing.")
    passed(f"replicas_in_sync: True on all {world_size} ranks for equal replicas, False on all "
           f"of them when one replica differs")
