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
on 3 ranks over a grid of cases, and judged from the evidence the grid gives: which rank differs
(0, 1, 2), which parameter (the first, the last, a bfloat16 or float64 one of odd size in a
second model, and a 0-dim one there), and how (0.5 off; then a +1e-3/-1e-3 pair, a position-weighted pair, a swap, a
sign flip, one unit in the last place in float32 and in float64, +0.0 against -0.0, NaNs of
other bits). A spy records the one number each rank passes into a collective: verdicts that go
in unlike and come out "in sync" on every rank name a combination that lets "same" win.
"Exactly equal" is the same bits: the same NaN on every replica is in sync. It must return a
Python bool.
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
           "bug_lines", "check_line", "move_line", "delete_line", "insert_line", "check_answer", "simulate", "run_fix",
           "judge_fix", "check_fix", "check_fixes", "examples_read", "check_prediction",
           "check_replicas_in_sync", "kept_division", "check_decision", "KEPT",
           "LOSS_HOLDS"]

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
    1: [("A", "Each rank draws its own random data with torch.randn, so the ranks train on two "
              "different data sets.",
         "the data's generator is seeded with the constant 1234 on every rank, so every rank "
         "draws the same 48 examples."),
        ("B", "Each rank's sampler shuffles its own permutation, so one epoch reads some "
              "examples twice and others never.", None),
        ("C", "Nothing broadcasts rank 0's initial weights, so each rank's replica starts from "
              "different random weights.",
         "torch.manual_seed(args.seed) seeds every rank alike right before the model is built, "
         "so every rank draws the same initial weights."),
        ("D", "Without drop_last, the sampler pads each rank's share with repeats, so some "
              "examples are read twice.",
         "DistributedSampler pads only when the data set does not split evenly over the ranks: "
         "48 examples over 2 ranks are 24 each, nothing padded.")],
    2: [("A", "The DistributedSampler is built without shuffle=True, so it deals the same "
              "order of examples in every epoch.",
         "shuffle=True is DistributedSampler's default, and set_epoch gives each epoch its own "
         "order."),
        ("B", "Two ranks of batch_size=4 make a global batch of 8, so the learning rate must "
              "double to match.",
         "scaling the learning rate with the batch is a tuning choice, not a data-parallel bug: "
         "the check compares with one device stepping with lr=0.1 on the global batch."),
        ("C", "The loader never draws from the sampler, so every rank reads all 48 examples "
              "each epoch.", None),
        ("D", "The loader shuffles with each rank's own random state, so the ranks read the "
              "examples in different orders.",
         "with no generator given, the loader's shuffle draws its seed from torch's default "
         "generator, which torch.manual_seed(args.seed) seeds alike on every rank: every rank "
         "gets the same order.")],
    3: [("A", "Each rank clips to max_norm before the average, so the averaged gradient's norm "
              "can still end up above max_norm.",
         "the mean of gradients that each have norm at most max_norm has norm at most max_norm "
         "(the norm of a sum is at most the sum of the norms): the step is bounded all the "
         "same."),
        ("B", "max_norm=0.2 is below the gradients' usual norm, so nearly every step is "
              "clipped and training stalls.",
         "how often the clip bites is a tuning choice: one device training on the global batch "
         "with max_norm=0.2 clips as often, and that run is what a correct script reproduces."),
        ("C", "The clip already scales the gradients down, so dividing their sum by world_size "
              "afterwards shrinks the step twice.",
         "dividing the sum by world_size is what makes it the mean, clip or no clip: the clip's "
         "factor max_norm / norm bounds a norm, it is not a division by world_size."),
        ("D", "Each rank bounds its own gradient's norm, which differs from bounding the norm "
              "of the averaged gradient.", None)],
    4: [("A", "Each rank seeds torch with args.seed + rank, so the ranks' tensors differ and "
              "the broadcast waits for them to agree.",
         "a broadcast carries whatever its sender holds and never compares the ranks' values: "
         "making different tensors equal is what it is for."),
        ("B", "The ranks pass different values of src, so they disagree about the root and no "
              "rank can finish the call.", None),
        ("C", "The loop broadcasts p.data, a tensor autograd does not track, and a collective "
              "waits for a parameter instead.",
         "a collective takes any dense tensor: p.data is one, the same storage as the "
         "parameter, so what it receives is written into the parameter itself."),
        ("D", "The broadcast runs right after init_process_group, before every rank is ready, "
              "so it waits forever.",
         "a collective waits until every rank of the group calls it: a rank that starts late "
         "only delays it, and every rank here does reach this broadcast.")],
    5: [("A", "dist.all_reduce averages by default, so the division after it divides the "
              "gradients a second time.",
         "dist.all_reduce sums by default (ReduceOp.SUM): what it hands back is the sum of the "
         "ranks' tensors."),
        ("B", "F.mse_loss already averages over the batch, so dividing the summed gradients by "
              "world_size makes them too small.",
         "the sum over the ranks adds world_size per-rank means: dividing that sum by "
         "world_size gives the mean over the global batch, the gradient one device steps with "
         "(the ranks' batches are equal)."),
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
                          "What must hold: every rank's sampler shuffles with one and the "
                          "same seed, the one the run's --seed gives, so the ranks cut their "
                          "slices from one permutation."),
    "sampler_seed_ignored": ("the sampler's seed no longer comes from --seed: the check ran the "
                             "script with --seed 3, and the sampler shuffled as if it were 0.",
                             "What must hold: the sampler's seed follows the run's --seed (a "
                             "run with another --seed shuffles otherwise), and is the same on "
                             "every rank."),
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
             5: ("yb) / world_size", "p.grad /= world_size")}
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
        "data's generator, the sampler's (its seed= as built, before set_epoch) and "
        "torch.manual_seed's", 1241, 0,
        "Read each line that seeds something with args.seed = 3 and rank = 1, and add the "
        "three seeds."),
    2: ("on 2 ranks, how many examples rank 1 reads in one epoch (the data set has 48)", 48, 0,
        "Follow the examples from the data set to the batches of the loop: which object hands "
        "rank 1 its batches, and from which examples?"),
    3: ("with the section's gradients g₀ = (3, 0) on rank 0 and g₁ = (0, 1) on rank 1, and "
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
# bug -> what the number is made of: said when effectN is wrong, so the sentence is about the
# number the learner worked out (a sum, a count, a ratio), not a hint at the bug
MADE_OF = {
    1: "each of the three seeds is read off its own line, with args.seed = 3 and rank = 1, "
       "before they are added",
    2: "it counts the examples rank 1's loop receives in one epoch, from whichever object hands "
       "its loader the indices",
    3: "it is the first component of what opt.step() receives once the script's lines, in "
       "their order, have run on g₀ = (3, 0) and g₁ = (0, 1) with max_norm = 1",
    4: "it counts the ranks that take the receiving side of the first dist.broadcast, given the "
       "src each rank passes",
    5: "it is how many times one device's gradient (of its mean loss over the global batch) is "
       "larger than the one opt.step() uses here, on 3 ranks",
}
# bug -> [(a wrong number a learner works out, its tolerance, what that number is)]: the
# mistakes behind a wrong effectN, named when the number gives them away
KNOWN_EFFECTS = {
    1: [(1241, 3, "close to that sum, but not it: recheck each of the three seeds, read off "
                  "its own line with args.seed = 3 and rank = 1, and the addition")],
    2: [(24, 0, "24 is what rank 1 would read if its loader drew its indices from the "
                "DistributedSampler (48 over 2 ranks), so follow which object this loader "
                "draws from"),
        (12, 0, "12 is a count of batches of 4, not of examples (and of a rank's half)")],
    3: [(3 / 10 ** 0.5, 0.01, "that is the first component one device steps with (the mean "
                              "(1.5, 0.5), then one clip of its norm 1.58 down to 1); the "
                              "question asks what this script's lines do, in their order"),
        (1.5, 0.01, "that is the mean with no clipping at all, and the script clips"),
        (1, 0.01, "that is rank 0's clipped gradient alone, before the lines that follow the "
                  "clip")],
    4: [(1, 0, "1 is what a broadcast does when every rank names the same src: one sender and "
               "world_size − 1 = 1 receiver. Read the src each rank passes here, with its own "
               "rank"),
        (2, 0, "2 would mean both ranks receive, and no rank sends")],
    5: [(9, 0.01, "9 counts the two divisions by 3 and leaves out the all_reduce, whose sum "
                  "multiplies by 3"),
        (2, 0.01, "2 is not a factor any line applies here: this script runs on 3 ranks "
                  "(world_size = 3, not the 2 of scripts 1 to 4), and two, the number of "
                  "divisions on the way, is not the factor they make together with the "
                  "all_reduce's sum"),
        (1 / 3, 0.01, "1/3 would make the step 3 times larger; the question asks how many "
                      "times smaller (3 if a third)"),
        (1, 0.01, "1 says the step uses one device's gradient: count every division by "
                  "world_size and every sum between the loss and opt.step()")],
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
        why = next((cause for value, near, cause in KNOWN_EFFECTS.get(n, ())
                    if abs(float(effect) - value) <= near), MADE_OF[n])
        fail(f"effect{n} = {effect!r} is not what {SCRIPTS[n]} does ({question}), so line "
             f"{line} is not judged: {why}.", fix=how)
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
    src, dst = _only_line(lines, line, "line"), _only_line(lines, before, "before")
    if src == dst:
        raise ValueError("line and before match the same line")
    moved = lines.pop(src)
    dst = dst - (src < dst)
    indent = lines[dst][:len(lines[dst]) - len(lines[dst].lstrip())]
    body = moved.strip("\r\n").lstrip()
    ending = moved[len(moved.rstrip("\r\n")):] or "\n"
    lines.insert(dst, indent + body + ending)
    return "".join(lines)


def _only_line(lines: list[str], part, name: str) -> int:
    if not isinstance(part, str) or not part.strip():
        raise ValueError(f"{name} must be a non-empty piece of one line; got {part!r}")
    hits = [i for i, ln in enumerate(lines) if part in ln]
    if len(hits) != 1:
        raise ValueError(f"{name}={part!r} must match exactly one line; it matches "
                         f"{len(hits)}" + (f" (lines {[i + 1 for i in hits]})" if hits else ""))
    return hits[0]


def delete_line(text: str, line: str) -> str:
    """``text`` without the one line that contains ``line`` (a ``ValueError`` if it matches no
    line or several)."""
    lines = text.splitlines(keepends=True)
    del lines[_only_line(lines, line, "line")]
    return "".join(lines)


def insert_line(text: str, new: str, before: str) -> str:
    """``text`` with ``new`` inserted as a whole line just before the one line that contains
    ``before``, indented like that line (no exact indentation or line ending to type)."""
    if not isinstance(new, str) or not new.strip() or "\n" in new.strip("\r\n"):
        raise ValueError(f"new must be one line of code; got {new!r}")
    lines = text.splitlines(keepends=True)
    dst = _only_line(lines, before, "before")
    indent = lines[dst][:len(lines[dst]) - len(lines[dst].lstrip())]
    ending = lines[dst][len(lines[dst].rstrip("\r\n")):] or "\n"
    lines.insert(dst, indent + new.strip() + ending)
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
def _simulate(world_size: int, seed: int, variant: str, clip, init_from: int = 0,
              replica: int = 0) -> dict:
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
    return {k: v.detach().clone() for k, v in models[replica].state_dict().items()}


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
        _read_fix_4(text)
    if n == 5 and _lines_with(text, "lr") != _lines_with(script(5), "lr"):
        fail("Fix 5: you changed the learning rate to make up for the gradients: they are "
             "still divided by world_size twice, and a larger lr undoes that for SGD only — "
             "Adam, weight decay or clipping would see gradients world_size times too small.",
             fix="Keep the learning rate and divide once.")


# --- bug 4: what a fix's text shows about where the replicas' first weights come from -------
#
# Script 4 seeds each rank with args.seed + rank on purpose (its comment: a random stream per
# rank, for dropout or augmentation), and the broadcast is what makes the replicas start from
# one rank's weights. A fix that deletes the broadcast, sends after the first forward, or names
# a sender the group does not have is refused by its text, before any launch, with the numbers
# the ranks would hold (drawn here exactly as the script draws them: same seeds, same model).

_SYNC_CALLS = {"broadcast", "broadcast_object_list", "all_gather", "all_gather_into_tensor",
               "all_gather_object", "scatter", "recv", "irecv", "load_state_dict",
               "all_reduce", "gather", "reduce_scatter"}


def _lab_weights(seed: int, draws_before: int = 0) -> dict:
    """The weights script 4's model starts from after torch.manual_seed(seed), with
    ``draws_before`` random numbers drawn first."""
    import torch

    torch.manual_seed(seed)
    torch.rand(draws_before)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _start_gap(draws_before: int = 0) -> float:
    """How far apart (the largest difference of one weight) rank 0's and rank 1's first
    weights are: seeded args.seed + rank as script 4 does, or (``draws_before``) both seeded
    alike with rank 0 alone drawing that many numbers first."""
    if draws_before:
        return _distance(_lab_weights(SEED, draws_before), _lab_weights(SEED))
    return _distance(_lab_weights(SEED), _lab_weights(SEED + 1))


def _end_gap() -> float:
    """How far apart rank 0's and rank 1's weights are after the 3 epochs of script 4 run with
    no broadcast: every step applies the same averaged update to both."""
    return _distance(_simulate(2, SEED, "no_broadcast", None, 0, 0),
                     _simulate(2, SEED, "no_broadcast", None, 0, 1))


def _mask_agreement(seeds) -> int:
    """In how many of 32 places a p = 0.5 dropout mask over a batch of 4 × 8 hidden units,
    drawn right after the model is built, agrees on two ranks seeded ``seeds``."""
    import torch

    masks = []
    for seed in seeds:
        _lab_weights(seed)
        masks.append(torch.rand(4, 8) < 0.5)
    return int((masks[0] == masks[1]).sum())


def _calls(tree, names) -> list:
    import ast

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in names:
                out.append(node)
    return sorted(out, key=lambda c: c.lineno)


def _mentions_rank(node) -> bool:
    import ast

    return any((isinstance(x, ast.Name) and x.id == "rank") or
               (isinstance(x, ast.Attribute) and x.attr == "get_rank") for x in ast.walk(node))


def _src_per_rank(text: str, call) -> tuple[str, list] | None:
    """The src expression of a broadcast call and what it is on each of script 4's 2 ranks
    (with the check's --seed), or None where it cannot be worked out here."""
    import ast
    import types

    node = next((k.value for k in call.keywords if k.arg == "src"),
                call.args[1] if len(call.args) > 1 else None)
    if node is None:
        return None
    expr = ast.get_source_segment(text, node) or ast.unparse(node)
    ws = WORLD_SIZES[4]
    values = []
    for r in range(ws):
        space = {"rank": r, "world_size": ws, "args": types.SimpleNamespace(seed=SEED,
                                                                            out="final.pt"),
                 "dist": types.SimpleNamespace(get_rank=lambda r=r: r,
                                               get_world_size=lambda: ws)}
        try:
            value = eval(compile(ast.Expression(node), "<src>", "eval"), {"__builtins__": {}},
                         space)
        except Exception:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        values.append(value)
    return expr, values


def _read_fix_4(text: str) -> None:
    """Refuse, by its text, a fix 4 that deletes the broadcast, sends after the first forward,
    or names a sender the group does not have (each with its own cause)."""
    __tracebackhide__ = True
    import ast

    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    ws = WORLD_SIZES[4]
    broadcasts = _calls(tree, {"broadcast"})
    for call in broadcasts:
        src = _src_per_rank(text, call)
        if src and any(not 0 <= v < ws for v in src[1]):
            expr, values = src
            said = (f"{values[0]} on every rank" if len(set(values)) == 1 else
                    ", ".join(f"{v} on rank {r}" for r, v in enumerate(values)))
            fail(f"Fix 4: the broadcast's src = `{expr}` is {said}, and a group of {ws} ranks "
                 f"has ranks {_and(range(ws))} only: it names a sender the group does not have"
                 + (", and it changes with --seed (the check runs --seed 3)"
                    if "seed" in expr else "") + ".",
                 fix=f"src is a rank of the group (0 to world_size − 1), the same on every "
                     f"rank.")
    forwards = [c.lineno for c in _calls(tree, {"model"})]
    forward = min(forwards, default=None)
    syncs = [c for c in _calls(tree, _SYNC_CALLS)
             if forward is None or c.lineno < forward]
    seeds = _calls(tree, {"manual_seed"})
    build = min((c.lineno for c in _calls(tree, {"Sequential"})), default=None)
    at_build = [c for c in seeds if build is None or c.lineno < build]
    per_rank_at_build = bool(at_build) and _mentions_rank(at_build[-1])
    per_rank_stream = any(_mentions_rank(c) for c in seeds)
    lost = ("the random stream the script keeps per rank (its comment: dropout, augmentation) "
            "is now one stream on every rank: drawn right after the model is built, a p = 0.5 "
            "dropout mask over a batch of 4 × 8 hidden units is the same on rank 0 and rank 1 "
            f"in {_mask_agreement((SEED, SEED))} of 32 places (with args.seed + rank, in "
            f"{_mask_agreement((SEED, SEED + 1))}). This model has no dropout, so its weights "
            f"cannot show it; a model with dropout would drop the same units on every rank")
    if not syncs and broadcasts and forward is not None:
        line = broadcasts[0].lineno
        loop_end = max((node.end_lineno for node in tree.body if isinstance(node, ast.For)
                        and node.lineno <= forward <= node.end_lineno), default=None)
        after = loop_end is not None and line > loop_end
        fail(f"Fix 4: the broadcast now runs after the first forward (line {line} of your "
             f"script comes after line {forward}, `model(xb)`): the first gradients were taken "
             f"on the weights each rank's own seed drew, up to {_start_gap():.2f} apart with "
             f"--seed 3, so the first averaged gradient mixes the gradients of two different "
             f"models" + ("; and after the training loop it only copies rank 0's weights over "
                          "replicas that trained apart" if after else "") + ".",
             fix="Every replica must hold the same weights before its first forward: send "
                 "them before the training loop.")
    if not syncs and per_rank_at_build:
        fail(f"Fix 4: the broadcast is gone, and the replicas no longer start from the same "
             f"weights: each rank builds its model after torch.manual_seed(args.seed + rank), so with "
             f"--seed 3 rank 0's and rank 1's first weights differ by up to "
             f"{_start_gap():.2f}. Every step then applies the same averaged update to both, "
             f"which moves them together and never closer: after the 3 epochs they still "
             f"differ by up to {_end_gap():.2f}, while the loss falls on both.",
             fix="Every replica must start from one rank's weights, sent to the others before "
                 "the first forward (the same sender named on every rank).")
    if not syncs and per_rank_stream:
        fail(f"Fix 4: the broadcast is gone: the replicas start equal only because every rank "
             f"seeds torch alike and draws nothing else before building the model — an "
             f"accident of the code's order that nothing in the run checks. One random number "
             f"more drawn on rank 0 alone before the model (a look at a random sample, say) "
             f"would start the replicas up to {_start_gap(draws_before=1):.2f} apart, and the "
             f"run would end, its loss falling, without a word. DDP, however the ranks were "
             f"seeded, sends rank 0's weights to every rank when it is built.",
             fix="Make the replicas equal by sending one rank's weights to the others, not by "
                 "seeding them alike.")
    if not syncs:
        fail(f"Fix 4: the broadcast is gone and every rank now seeds torch with args.seed "
             f"alone: the replicas start equal, but {lost}.",
             fix="Keep args.seed + rank for each rank's own stream, and make the replicas "
                 "equal by sending one rank's weights to the others.")
    if seeds and not per_rank_stream:
        fail(f"Fix 4: every rank now seeds torch with args.seed alone: {lost}.",
             fix="Keep args.seed + rank: the bug is not the seeding.")


def _name_hang(n: int, text, result):
    """A hang of fix 4 whose src still differs from rank to rank: the hang's sentence, and what
    src is on each rank."""
    import ast

    if n != 4 or not isinstance(result, str) or not result.startswith("it did not finish"):
        return result
    try:
        calls = _calls(ast.parse(text), {"broadcast"})
    except SyntaxError:
        return result
    for call in calls:
        src = _src_per_rank(text, call)
        if src and len(set(src[1])) > 1:
            expr, values = src
            said = " and ".join(f"{v} on rank {r}" for r, v in enumerate(values))
            return (f"{result.rstrip('.')}. Here src = `{expr}` is {said}: the ranks still "
                    f"disagree about which one sends.")
    return result


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


# bug 5's design decision, three answers the check judges against the repair the fixed script
# made (kept_division reads it from the code, comments aside), none of them a list of the
# repairs: the line of the division the fix kept (a number read off lab10.show(5)), what `loss`
# holds on a rank afterwards (one of LOSS_HOLDS), and, once the loop moves to DDP with nothing
# else changed, how many times smaller than one device's gradient the step is. DDP averages
# the gradients over the ranks, dividing their sum by world_size itself (torch/nn/parallel/
# distributed.py, divide_by_initial_world_size), so the hand-written all_reduce loop goes.
KEPT = {"loss": "yb) / world_size", "gradients": "p.grad /= world_size"}
LOSS_HOLDS = ("this rank's mean", "this rank's mean / world_size", "the global mean")
_HOLDS = {"loss": "this rank's mean / world_size", "gradients": "this rank's mean"}
_UNDER_DDP = {"loss": WORLD_SIZES[5], "gradients": 1}
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
# (the repair kept, a wrong number) -> what that number is; any other: _DDP_MADE_OF
_DDP_CAUSE = {
    ("gradients", 3):
        "3 is bug 5's factor, two divisions by world_size; your fixed5's loss divides by "
        "nothing, so under DDP the one division by world_size left is DDP's own, of the sum "
        "over the ranks",
    ("gradients", 9):
        "9 counts a division by world_size your fixed5 no longer has",
    ("loss", 1):
        "your fixed5's loss still divides by world_size, and DDP divides the sum over the ranks "
        "by world_size as well: once the hand-written loop (which divided nothing) is gone, "
        "the loss's division is undone by nothing",
    ("loss", 9):
        "9 counts DDP's division and your loss's, and leaves out the sum DDP's all-reduce makes "
        "before it divides",
}
_DDP_MADE_OF = ("it is how many times one device's gradient (of its mean loss over the global "
                "batch) is larger than the one opt.step() would use under DDP, on 3 ranks, "
                "with your fixed5's loss line unchanged and the hand-written loop gone; 1/3 "
                "would be a step 3 times larger")


@recorded
def check_decision(fixed5: str, kept, loss_holds, under_ddp) -> None:
    """Bug 5's design decision, judged against the repair ``fixed5`` made: ``kept``, the line
    number (as :func:`show` prints script 5) of the division by world_size the fix kept;
    ``loss_holds``, what ``loss`` holds on a rank afterwards (one of :data:`LOSS_HOLDS`);
    ``under_ddp``, once the loop moves to DDP (its hand-written all_reduce loop gone, nothing
    else changed), how many times smaller than one device's gradient the step is, on 3 ranks."""
    __tracebackhide__ = True
    if not isinstance(fixed5, str):
        fail(f"Pass fixed5, your fixed script's text (a str), not {type(fixed5).__name__}.")
    lines = script(5).splitlines()
    if isinstance(kept, bool) or not isinstance(kept, int) or not 1 <= kept <= len(lines):
        fail(f"kept should be a line number of {SCRIPTS[5]}, 1 to {len(lines)} as "
             f"lab10.show(5) numbers them; got {kept!r}.")
    if loss_holds not in LOSS_HOLDS:
        fail(f"loss_holds is {loss_holds!r}: it must be one of "
             f"{', '.join(repr(a) for a in LOSS_HOLDS)}, written exactly so.")
    if not _is_number(under_ddp) or under_ddp != under_ddp:
        fail(f"under_ddp should be a number (how many times smaller than one device's gradient "
             f"the step is under DDP; 1 if the same); got {under_ddp!r}.")
    said = next((name for name, piece in KEPT.items() if piece in lines[kept - 1]), None)
    if said is None:
        code = lines[kept - 1].strip() or "(a blank line)"
        fail(f"Decision 5: line {kept} of {SCRIPTS[5]} (`{code}`) is not a division by "
             f"world_size, so no fix keeps it as one.",
             fix="kept is the number of the line, in the broken script's listing, whose "
                 "division by world_size your fixed5 still has.")
    code = {"loss": "loss", "gradient": "gradients"}.get(kept_division(fixed5))
    if code is None:
        fail("Decision 5: your fixed5 divides by world_size in both places or in neither, so "
             "it keeps no single division to decide about.",
             fix="Fix bug 5 first (lab10.check_fix(5, fixed5)), then answer for that fix.")
    if said != code:
        what = {"loss": "the line that computes `loss` divides by world_size and the "
                        "gradients are not divided after all_reduce",
                "gradients": "the gradients are divided by world_size after all_reduce and "
                             "the line that computes `loss` divides by nothing"}[code]
        fail(f"Decision 5: kept = {kept} is the line that divides the "
             f"{'loss' if said == 'loss' else 'gradients'} by world_size, but in your fixed5 "
             f"{what}.",
             fix="Answer for the repair your fixed5 makes (or change fixed5): the line whose "
                 "division it kept.")
    if loss_holds != _HOLDS[code]:
        fail(f"Decision 5: loss_holds = {loss_holds!r}, but {_LOSS_CAUSE[code, loss_holds]}.",
             fix=f"loss_holds = {_HOLDS[code]!r}.")
    right = _UNDER_DDP[code]
    if abs(float(under_ddp) - right) > 0.01:
        cause = next((c for (k, v), c in _DDP_CAUSE.items()
                      if k == code and abs(float(under_ddp) - v) <= 0.01), _DDP_MADE_OF)
        fail(f"Decision 5: under_ddp = {under_ddp!r} is not what DDP would do with your "
             f"fixed5: {cause}.", fix=f"under_ddp = {right}.")
    passed({"loss": "decision 5: kept the loss's division; `loss` holds this rank's mean / "
                    "world_size, and under DDP every step would be world_size times too small "
                    "unless that division goes with the hand-written loop",
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
    judge_fix(n, _name_hang(n, text, run_fix(n, text, timeout, launcher)))
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
        judge_fix(n, _name_hang(n, fixes[n], results[n]))
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


# --- stretch: a detector for replicas that differ ------------------------------------------
#
# The check runs the learner's detector on a grid of cases and judges it from the evidence the
# grid gives, never from one outcome alone: which RANK differs (0, 1, 2: a detector that leaves
# a rank out sees the others), which PARAMETER (the first, the last, one of another dtype: a
# detector that leaves one out sees the rest), and HOW (0.5 off, which anything that looks
# sees; then the ways a summary, a tolerance or a comparison of values misses). What the ranks
# passed into each collective that carried one 0/1 number is recorded too: verdicts that
# disagree going in and "in sync" on every rank coming out is the evidence that the way they
# were combined let a "same" win.

_OFF = 0.5  # "plainly off": a sum, a norm, a tolerance all see it
# the second model's parameters: not float32, and of odd sizes (a view as int32 of a 5-number
# bfloat16 tensor raises; float64 narrowed to float32 loses its last bits)
_MIXED = {"scale": ("bfloat16", 5), "offset": ("float64", 3)}
_MIXED_SAID = ("the second model (a bfloat16 parameter of 5 numbers, a float64 one of 3, a "
               "0-dim float32 temperature)")


def _lab_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _mixed_model():
    import torch

    torch.manual_seed(1)
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(6, 8)
    for name, (dtype, n) in _MIXED.items():
        model.register_parameter(name, torch.nn.Parameter(
            torch.randn(n, dtype=torch.float64).to(getattr(torch, dtype))))
    # a learnable scalar (0-dim: shape ()), as a softmax temperature or a loss scale is
    model.temperature = torch.nn.Parameter(torch.tensor(0.7))
    return model


def _cases(world_size: int) -> dict:
    """case -> (model, the rank that differs or None, in sync?, what the learner reads)."""
    last = world_size - 1
    cases = {"same": ("lab", None, True, "every replica identical"),
             "same_nan": ("lab", None, True, "the same NaN, with the same bits, at the same "
                                             "place on every replica"),
             "same_mixed": ("mixed", None, True, f"identical replicas of {_MIXED_SAID}")}
    for r in range(world_size):
        cases[f"first_r{r}"] = ("lab", r, False, f"rank {r}'s first weight (0.weight) "
                                                 f"{_OFF} off")
    for r in range(world_size):
        cases[f"last_r{r}"] = ("lab", r, False, f"rank {r}'s last parameter (2.bias, one "
                                                f"number) {_OFF} off")
    cases["bf16_off"] = ("mixed", 1 % world_size, False, f"rank {1 % world_size}'s bfloat16 "
                         f"parameter (scale) {_OFF} off, in {_MIXED_SAID}")
    cases["f64_off"] = ("mixed", last, False, f"rank {last}'s float64 parameter (offset) "
                        f"{_OFF} off, in {_MIXED_SAID}")
    cases["scalar_off"] = ("mixed", 0, False, f"rank 0's 0-dim temperature {_OFF} off, in "
                           f"{_MIXED_SAID}")
    cases.update({
        "small_off": ("lab", last, False, "one weight 1e-3 off"),
        "off_keeping_sum": ("lab", last, False, "one weight +1e-3 and the next -1e-3"),
        "off_keeping_weighted_sum": ("lab", last, False, "one weight +2⁻⁹ and the next −2⁻¹⁰"),
        "swapped": ("lab", last, False, "two weights swapped"),
        "sign_flipped": ("lab", last, False, "one weight's sign flipped"),
        "one_ulp": ("lab", last, False, "one float32 weight one unit in the last place away "
                                        "(torch.nextafter)"),
        "f64_ulp": ("mixed", last, False, "one float64 number one unit in the last place away "
                                          f"(torch.nextafter), in {_MIXED_SAID}"),
        "signed_zero": ("lab", last, False, "one weight +0.0 on the other ranks and −0.0 on "
                                            "one"),
        "nan_other_bits": ("lab", last, False, "a NaN at the same place on every replica, "
                                               "with other bits on one"),
    })
    return cases


def _case_model(case: str, spec, rank: int):
    import torch

    kind, who, _, _ = spec
    model = _lab_model() if kind == "lab" else _mixed_model()
    named = dict(model.named_parameters())
    with torch.no_grad():
        if kind == "mixed":
            if rank == who:
                if case == "bf16_off":
                    named["scale"].view(-1)[2] += _OFF
                if case == "f64_off":
                    named["offset"].view(-1)[1] += _OFF
                if case == "scalar_off":
                    named["temperature"] += _OFF
                if case == "f64_ulp":
                    x = named["offset"].view(-1)
                    x[1] = torch.nextafter(x[1], torch.tensor(float("inf"), dtype=x.dtype))
            return model
        first = named["0.weight"].view(-1)
        if case == "off_keeping_weighted_sum":   # exact binary values on every rank
            first[0], first[1] = 0.25, 0.5
        if case == "same_nan":                   # the same bits on every rank
            first[4] = float("nan")
        if case == "nan_other_bits":             # a NaN everywhere; one rank's has other bits
            first.view(torch.int32)[4] = 0x7FC00001 if rank == who else 0x7FC00000
        if case == "signed_zero":                # equal as values, not as bits
            first[5] = -0.0 if rank == who else 0.0
        if rank != who:
            return model
        if case.startswith("first_r"):
            first[0] += _OFF
        if case.startswith("last_r"):
            named["2.bias"].view(-1)[0] += _OFF
        if case == "off_keeping_weighted_sum":
            # +2δ at position 1 and −δ at position 2: a sum weighted 1, 2, 3, … (lesson 10's
            # checksum) stays exactly the same; a plain sum does not
            first[0] += 2.0 ** -9
            first[1] -= 2.0 ** -10
        if case == "small_off":                  # a sum sees it; a loose tolerance does not
            first[6] += 1e-3
        if case == "off_keeping_sum":            # the sum of everything stays the same
            first[0] += 1e-3
            first[1] -= 1e-3
        if case == "swapped":                    # sum, norm and sorted values stay the same
            first[0], first[1] = first[1].clone(), first[0].clone()
        if case == "sign_flipped":               # the norm and the absolute values stay the same
            first[2] = -first[2]
        if case == "one_ulp":                    # the next float32 up
            first[3] = torch.nextafter(first[3], torch.tensor(float("inf")))
    return model


def _one_number(value):
    """The number a collective carries in when it carries exactly one (a verdict, a count, a
    checksum), else None."""
    import torch

    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[0]) if value.numel() == 1 else None
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return _one_number(value[0])
    return None


def _said(call) -> str:
    """A collective as the learner wrote it: "all_reduce with ReduceOp.MAX", "broadcast from
    rank 0", "all_gather_object"."""
    import torch.distributed as dist

    args = call.args or {}
    if call.op in ("all_reduce", "reduce"):
        op = args.get("op", dist.ReduceOp.SUM)
        name = next((n for n in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG")
                     if op == getattr(dist.ReduceOp, n)), str(op))
        return f"{call.function} with ReduceOp.{name}"
    if call.op == "broadcast":
        src = args.get("src", args.get("group_src"))
        return f"{call.function} from rank {src}"
    return call.function


def _detector_worker(rank, world_size, fn):
    __tracebackhide__ = True
    import torch

    from ..collectives import RECORDED, RECORDED_FUNCOL, record_collectives

    results = {}

    for case, spec in _cases(world_size).items():
        model = _case_model(case, spec, rank)
        params = list(model.parameters())
        before = [p.detach().clone() for p in params]
        small = []  # (the collective as written, the one number this rank passed in)

        def spy(call):
            table = RECORDED_FUNCOL if call.function.startswith("funcol.") else RECORDED
            read = table.get(call.function.removeprefix("funcol."), (None, None, None))[1]
            number = _one_number((call.args or {}).get(read)) if read else None
            if number is not None:
                small.append((_said(call), number))

        try:
            with record_collectives(before=spy) as calls:
                verdict = fn(model)
        except NotImplementedError:
            raise
        except Exception as exc:  # the same model on every rank: every rank raises here
            results[case] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                                      if str(exc) else type(exc).__name__}
            return results
        # the most numbers any one collective carried in or out: a rank that never received
        # more than a verdict per rank compared its weights with nothing but its own
        carried = max((max(c.numel, c.out_numel) if c.dtype is not None else
                       max(c.nbytes, c.out_nbytes) // 8 for c in calls), default=0)
        # bit for bit: a NaN kept in place is not a change, a +0.0 made -0.0 is
        changed = any(not torch.equal(b.reshape(-1).view(torch.uint8),
                                      p.detach().reshape(-1).view(torch.uint8))
                      for b, p in zip(before, params))
        results[case] = {"verdict": verdict if isinstance(verdict, bool) else None,
                         "returned": None if isinstance(verdict, bool) else
                         f"{type(verdict).__module__}.{type(verdict).__qualname__}"
                         .removeprefix("builtins.") + f" ({verdict!r:.40})",
                         "changed": changed, "small": small, "carried": carried}
    return results


def _combined_wrong(ranks, case):
    """The evidence that one rank's "same" won: the last collective of this case through which
    every rank passed one 0/1 number, those numbers not all alike. (said, [number per rank])."""
    lists = [r[case]["small"] for r in ranks]
    if len({len(s) for s in lists}) != 1:
        return None
    for k in reversed(range(len(lists[0]))):
        numbers = [s[k][1] for s in lists]
        if set(numbers) <= {0.0, 1.0} and len(set(numbers)) > 1:
            return lists[0][k][0], numbers
    return None


def _and(items) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


_BITS_FIX = ("Compare the bits: view each parameter as integers of its own element size, or as "
             "bytes (torch.uint8), which fit every dtype, before comparing.")


@recorded
def check_replicas_in_sync(replicas_in_sync, world_size: int = 3,
                           timeout: float | None = None):
    """Stretch: on ``world_size`` ranks, ``replicas_in_sync(model)`` must return True (a Python
    bool) on every rank when all replicas hold the same parameters, bit for bit, and False on
    every rank when one differs — whichever rank, whichever parameter, whatever its dtype."""
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
    cases = _cases(world_size)
    for case, (kind, who, want, said) in cases.items():
        errors = [r[case]["error"] for r in ranks if "error" in r.get(case, {})]
        if errors:
            error = errors[0]
            if ("cannot be 0 to view" in error or "zero-dimensional tensor" in error) and \
                    cases[case][0] == "mixed":
                fail(f"with {said}, replicas_in_sync raised {error}. The temperature is a "
                     f"0-dim parameter (shape (), one number, no dimension at all): a view "
                     f"as another element size works along the last dimension, and torch.cat "
                     f"joins along a dimension, so neither takes a 0-dim tensor as it is — "
                     f"and a learnable scalar is a parameter like any other.",
                     fix="Give every parameter one dimension before viewing or joining it: "
                         "p.reshape(-1) (or p.flatten()) is a 1-dim tensor for any shape, "
                         "0-dim included.")
            if "different element sizes" in error:
                fail(f"with {said}, replicas_in_sync raised {error}. A view as integers of "
                     f"another element size needs each tensor's last dimension to split into "
                     f"them evenly: it works for the lab's float32 weights as int32, not for 5 "
                     f"bfloat16 numbers (10 bytes), and a detector is called on whatever model "
                     f"the job trains.", fix=_BITS_FIX)
            if "Invalid scalar type" in error:
                fail(f"with {said}, replicas_in_sync raised {error}: a collective was handed a "
                     f"tensor of a dtype that gloo, the CPU backend the check runs on, cannot "
                     f"carry (it carries uint8, int8, int32, int64, bool and the float types; "
                     f"not int16).",
                     fix="Hand the collective the bits as bytes (torch.uint8), or as int32 or "
                         "int64 where the sizes allow.")
            fail(f"with {said}, replicas_in_sync raised {error}.")
        returned = [r[case]["returned"] for r in ranks if r[case]["returned"] is not None]
        if returned:
            fail(f"with {said}, replicas_in_sync returned {returned[0]}, not a Python bool: an "
                 f"`if` reads it, but `replicas_in_sync(model) is True` is False, "
                 f"`== True` on a tensor gives a tensor, and the contract (what a caller may "
                 f"rely on) says bool.",
                 fix="Return bool(...) of your verdict (tensor.item() gives a Python number).")
        if any(r[case]["changed"] for r in ranks):
            fail("replicas_in_sync changed the model's parameters: a detector that repairs what "
                 "it inspects hides the very difference it should report.",
                 fix="Only compare: broadcast or gather copies, never into the parameters.")
        verdicts = [r[case]["verdict"] for r in ranks]
        if len(set(verdicts)) > 1:
            fail(f"the ranks disagree (verdicts {verdicts} on ranks 0 to {world_size - 1}, with "
                 f"{said}): each rank answered from what it alone saw.",
                 fix="Every rank must return the same verdict: combine them with a collective.")
    verdict = {case: ranks[0][case]["verdict"] for case in cases}
    for case in ("same", "same_mixed"):
        if verdict[case] is False:
            fail(f"with {cases[case][3]}, replicas_in_sync returned False on every rank: it saw "
                 f"a difference where there is none.",
                 fix="Compare each rank's bits with one reference copy's, every one of them.")
    blind = [c for c, (_, _, want, _) in cases.items() if not want and verdict[c]]
    nan_refused = verdict["same_nan"] is False
    if not blind and not nan_refused:
        passed(f"replicas_in_sync: True on all {world_size} ranks for equal replicas, False on "
               f"all of them whichever rank, parameter or bit differs")
        return
    # 1. the verdicts went into the last collective unlike, and came out "in sync" everywhere
    for case in blind:
        evidence = _combined_wrong(ranks, case)
        if evidence:
            how, numbers = evidence
            went_in = ", ".join(f"rank {r}: {n:g}" for r, n in enumerate(numbers))
            fail(f"with {cases[case][3]}, the ranks went into your {how} with different "
                 f"verdicts ({went_in}) and every rank came out with True: the way they are "
                 f"combined lets one rank's 'in sync' outvote the rank that saw a difference.",
                 fix="A 'differs' on any rank must win: ReduceOp.MIN over 1-for-same flags, "
                     "MAX over 1-for-differs flags, or all() of the gathered verdicts.")
    # 2. which rank: the same 0.5 is seen on some ranks, missed on others
    firsts = {r: f"first_r{r}" in blind for r in range(world_size)}
    missed = [r for r, b in firsts.items() if b]
    if missed and len(missed) < world_size:
        seen = [r for r, b in firsts.items() if not b]
        fail(f"with {cases[f'first_r{missed[0]}'][3]}, every rank returned True, while the same "
             f"{_OFF} on rank{'s' * (len(seen) > 1)} {_and(seen)} was "
             f"seen: your detector never compares rank{'s' * (len(missed) > 1)} "
             f"{_and(missed)}'s weights with the others'.",
             fix="Every rank's weights must be compared with the reference: check which ranks "
                 "your indexing or your loop leaves out.")
    if missed:
        carried = max(r[c]["carried"] for r in ranks for c in blind)
        numel = sum(p.numel() for p in _lab_model().parameters())
        if carried <= world_size:
            fail(f"whenever one replica differed, even by {_OFF}, every rank returned True, and "
                 f"no collective carried more than {carried} number{'s' * (carried != 1)} (a "
                 f"verdict per rank at most; the model has {numel} parameters): no rank ever "
                 f"received another rank's weights, so each compared its weights with a copy "
                 f"of its own and found them equal.",
                 fix="Every rank must compare its own weights with the same reference copy, "
                     "one rank's, received from it by a collective.")
        fail(f"whenever one replica differed, even by {_OFF} in its first weight, every rank "
             f"returned True, though weights did travel (a collective carried {carried} "
             f"numbers): the verdict does not come from comparing what a rank received with "
             f"what it holds.",
             fix="Compare each rank's own weights with the copy it received, then combine.")
    # 3. which parameter: the first weight's 0.5 is seen, another parameter's is missed
    params = [c for c in blind if c.startswith("last_r") or c in ("bf16_off", "f64_off",
                                                                  "scalar_off")]
    if params:
        lasts = [c.removeprefix("last_r") for c in params if c.startswith("last_r")]
        what = ([f"the last parameter (2.bias, one number) on rank{'s' * (len(lasts) > 1)} "
                 f"{_and(lasts)}"] if lasts else []) + [
            {"bf16_off": "the bfloat16 parameter (scale)",
             "f64_off": "the float64 parameter (offset)",
             "scalar_off": "the 0-dim parameter (temperature)"}[c] + " of " + _MIXED_SAID
            for c in params if not c.startswith("last_r")]
        fail(f"with {_OFF} added to {'; to '.join(what)}, replicas_in_sync returned True on "
             f"every rank, while {_OFF} on the first weight was seen: your detector does not "
             f"compare every parameter.",
             fix="Compare every parameter, whatever its place or dtype (model.parameters(), "
                 "all of them).")
    # 4. how: what the comparison itself cannot see
    where = ", ".join(cases[c][3] for c in blind)
    nan_said = (" And with the same NaN at the same place on every replica (the same bits) it "
                "returned False: a NaN never equals itself as a value." if nan_refused else "")
    if blind:
        fix = "Compare every value, in place."
        values = {"signed_zero", "nan_other_bits"}
        tolerance = {"small_off", "off_keeping_sum", "off_keeping_weighted_sum", "one_ulp",
                     "f64_ulp", *values}
        if "one_ulp" in blind and set(blind) <= tolerance and (
                "small_off" in blind or "off_keeping_sum" not in blind):
            why = ("your comparison has a tolerance (allclose, isclose, a difference below some "
                   "size, or a cast to a shorter float before comparing), and it let that pass; "
                   "the lab's 'exactly equal' is the same bits, and a replica one float away "
                   "from the others is out of sync")
            fix = "Compare exactly: the same bits, no tolerance."
        elif set(blind) == {"f64_ulp"}:
            why = ("one float32 step was seen and one float64 step was not: your comparison "
                   "narrows float64 to a shorter float (.float(), a float32 buffer), which "
                   "rounds the last bits away")
            fix = "Compare each parameter's bits in its own dtype, without converting it."
        elif set(blind) <= values:
            why = ("you compare values (torch.equal, ==, allclose with equal_nan), and as "
                   "values " + (" and ".join(
                       (["−0.0 == +0.0"] if "signed_zero" in blind else [])
                       + (["two NaNs are both 'NaN'"] if "nan_other_bits" in blind else [])))
                   + "; the lab's 'exactly equal' is the same bits, and these differ"
                   + ("." + nan_said.rstrip(".") if nan_said else ""))
            fix = _BITS_FIX
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
            why = "what you compare cannot see every kind of difference"
        fail(f"the replicas differ ({where}) but replicas_in_sync returned True on every "
             f"rank: {why}.", fix=fix)
    fail(f"every replica holds the same NaN at the same place (the same bits: in sync, by "
         f"the lab's rule), and replicas_in_sync returned False on every rank: you compare "
         f"values, and a NaN never equals itself as a value.", fix=_BITS_FIX)
