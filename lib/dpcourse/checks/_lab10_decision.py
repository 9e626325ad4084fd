"""Lab 10, bug 5's design decision (solutions/lab10_bug_hunt.py, "Bug 5"): which of the two
divisions by world_size the learner's fix kept, read from its code, and the three answers
:func:`check_decision` judges against that repair — the line kept, what ``loss`` holds on a
rank afterwards, and how many times too small the step would be once the loop moves to DDP.

Exported by :mod:`dpcourse.checks.lab10`, where the lab calls it.
"""

from __future__ import annotations

from dpcourse.checks import fail, passed, recorded
from dpcourse.checks._lab10_scripts import SCRIPTS, WORLD_SIZES, _is_number, script

__all__ = ["kept_division", "KEPT", "LOSS_HOLDS", "check_decision"]


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
