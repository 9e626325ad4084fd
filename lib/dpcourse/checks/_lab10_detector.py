"""Lab 10's stretch (solutions/lab10_bug_hunt.py, "Stretch"): a detector for replicas that
differ, ``replicas_in_sync(model)``, run on 3 ranks over a grid of cases and judged from the
evidence the grid gives — which rank differs, which parameter (of which dtype, a 0-dim one
included), and how (plainly off, or in the ways a summary, a tolerance or a comparison of values
misses); a spy records the one number each rank passes into a collective, so verdicts combined
so that "same" wins are named as such.

Exported by :mod:`dpcourse.checks.lab10`, where the lab calls :func:`check_replicas_in_sync`.
"""

from __future__ import annotations

from dpcourse.checks import check_timeout, fail, passed, recorded, run_ranks

__all__ = ["check_replicas_in_sync"]


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
    small = []  # this case's (the collective as written, the one number this rank passed in)

    def spy(call):
        table = RECORDED_FUNCOL if call.function.startswith("funcol.") else RECORDED
        read = table.get(call.function.removeprefix("funcol."), (None, None, None))[1]
        number = _one_number((call.args or {}).get(read)) if read else None
        if number is not None:
            small.append((_said(call), number))

    # One recording for the whole grid, each case reading the calls it made: setting one up
    # wraps every collective (about a millisecond), and a grid has 20 cases on every rank.
    with record_collectives(before=spy) as log:
        for case, spec in _cases(world_size).items():
            model = _case_model(case, spec, rank)
            params = list(model.parameters())
            before = [p.detach().clone() for p in params]
            small, first = [], len(log)
            try:
                verdict = fn(model)
            except NotImplementedError:
                raise
            except Exception as exc:  # the same model on every rank: every rank raises here
                results[case] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                                          if str(exc) else type(exc).__name__}
                return results
            calls = log[first:]
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
