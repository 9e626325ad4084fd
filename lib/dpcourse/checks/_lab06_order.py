"""Lab 06, part 3's design decision: the order of each step's blocking send and receive, judged
by the time the ring takes in *transfer times*.

:func:`_rounds` is the model: every transfer takes one time unit, and a gloo send goes out only
once its receiver is in the matching ``dist.recv`` (``Pair::send``). It returns when the ring's
last transfer ends: the whole ring's time, its critical path, not a step's. Gloo ranks do not
wait for one another between steps, so a slow start-up (a chain of sends waiting for one
another) overlaps the later steps and is paid once; the check therefore judges the whole
ring's time divided by its 2(N-1) steps, the time per step *on average* (what a ring's user
pays), and says so. Measured with gloo on 8 and 12 ranks, each transfer padded to 20 ms: "the
first half of the ranks send first" took 2.36 transfer times per step on average on both
(even/odd 2.24 and 2.19; rank 0 alone sending first 8.3 and 12.8; ranks 0 and 1 sending first
4.2 and 6.3), as the model says (2.2; 2.0; 8 and 12; 4.1 and 6.0). The model also gives each
step's *slowest* share (:func:`_slowest_step`) for the ✔ line.

The order is found from the calls the ranks made (3, 2 and 4 ranks,
:func:`_recorded_orders`) and, on 5, 7, 8 and 16 ranks, from a dry run of the learner's code with
stand-ins that only note the calls (:func:`_dry_orders`). An order that deadlocks on more
ranks, one whose steps run around the ring one transfer after another
(:func:`_refuse_serialised_steps`), and one whose time per step grows with N
(:func:`_refuse_growing_steps`) are refused, each with its own sentence.
"""

from __future__ import annotations

import numpy as np

from dpcourse.checks import fail

class _DryRunStop(Exception):
    pass


_DRY_NUMEL = 5  # elements per rank in the dry run: 2N + 5, so that no chunk is empty


def _dry_orders(fn, sizes):
    """The order in which ``fn`` makes its blocking calls on every rank of each group size in
    ``sizes``, found without sending anything: ``fn`` runs once per rank in this process, with
    ``torch.distributed``'s ``get_rank``, ``get_world_size``, ``send`` and ``recv`` replaced by
    stand-ins that only note the call (a receive leaves its buffer as it was). Returns
    ``{N: [[("send"|"recv", peer), ...] for each rank]}``, or a string saying why the order
    could not be found (any other torch.distributed call stops the dry run: it is not judged)."""
    import torch
    import torch.distributed as dist

    from ..collectives import RECORDED

    def stop(*args, **kwargs):
        raise _DryRunStop("another torch.distributed call")

    # every built-in collective too: one called with a stand-in rank could wait forever
    replaced = ["get_rank", "get_world_size", "send", "recv", "isend", "irecv",
                "batch_isend_irecv", *RECORDED]
    saved = {name: getattr(dist, name) for name in replaced if hasattr(dist, name)}
    orders: dict = {}
    try:
        for name in saved:
            setattr(dist, name, stop)
        for n in sizes:
            orders[n] = []
            for r in range(n):
                calls: list = []

                def send(tensor, dst=None, group=None, tag=0, group_dst=None, _calls=calls):
                    _calls.append(("send", dst if dst is not None else group_dst))

                def recv(tensor=None, src=None, group=None, tag=0, group_src=None,
                         _calls=calls):
                    peer = src if src is not None else group_src
                    _calls.append(("recv", peer))
                    return peer

                dist.get_rank = lambda *a, _r=r, **k: _r
                dist.get_world_size = lambda *a, _n=n, **k: _n
                dist.send, dist.recv = send, recv
                x = torch.arange(1.0, 2 * n + _DRY_NUMEL + 1, dtype=torch.float64)
                fn(x, op="sum")
                orders[n].append(calls)
    except _DryRunStop as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the learner's code, run with stand-ins
        return f"{type(exc).__name__}: {exc}"
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
    return orders


def _play(orders):
    """Play the model: ``orders[r]`` is rank r's blocking calls in order, as (op, peer). Every
    transfer takes one time unit, and a gloo send goes out only once its receiver is in the
    matching recv (``Pair::send``): each time unit, every send whose peer is at the matching
    receive completes, and both ranks move on to their next call. Returns (``ends``, the ranks
    still waiting): ``ends[r][k]`` is when rank r's call k completed."""
    n = len(orders)
    at = [0] * n
    ends: list[list[int]] = [[] for _ in range(n)]
    while True:
        meets = []
        for i in range(n):
            if at[i] < len(orders[i]) and orders[i][at[i]][0] == "send":
                j = orders[i][at[i]][1]
                if (isinstance(j, int) and 0 <= j < n and at[j] < len(orders[j])
                        and orders[j][at[j]] == ("recv", i)):
                    meets.append((i, j))
        if not meets:
            break
        for i, j in meets:
            done = max(ends[i][-1] if ends[i] else 0, ends[j][-1] if ends[j] else 0) + 1
            ends[i].append(done)
            ends[j].append(done)
            at[i] += 1
            at[j] += 1
    return ends, [r for r in range(n) if at[r] < len(orders[r])]


def _rounds(orders):
    """How many transfer times the whole ring takes under :func:`_play`'s model: when its last
    transfer ends (its critical path, all steps together). Returns (time units, None), or
    (None, the ranks still waiting) when no pair can meet: a deadlock."""
    ends, waiting = _play(orders)
    return (None, waiting) if waiting else (max(e[-1] for e in ends if e), None)


def _slowest_step(orders, calls_per_step: int = 2):
    """The slowest step under :func:`_play`'s model, as (its 1-based number, its length): step
    s ends when the last rank makes the last call of step s, and its length is how much later
    that is than the end of step s - 1. The lengths add up to :func:`_rounds`'s time. None on a
    deadlock, or when the ranks do not all make ``calls_per_step`` calls per step."""
    ends, waiting = _play(orders)
    lengths = {len(e) for e in ends}
    if waiting or len(lengths) != 1 or lengths.pop() % calls_per_step:
        return None
    steps = len(ends[0]) // calls_per_step
    finish = [max(e[(s + 1) * calls_per_step - 1] for e in ends) for s in range(steps)]
    durations = [b - a for a, b in zip([0] + finish, finish)]
    longest = max(durations)
    return durations.index(longest) + 1, longest


def _recorded_orders(case_traffic, n: int):
    """A real run's blocking calls per rank, in order, as (op, peer): the contract's peers (the
    check has already compared the results, so every send went right and every receive came
    from the left)."""
    return [[(op, (r + 1) % n if op == "send" else (r - 1) % n)
             for kind, op, _, _ in t["events"] if kind == "post"] for r, t in
            enumerate(case_traffic)]


def _longest_same_run(first: list) -> tuple[int, int]:
    """The longest run of neighbouring ranks (around the ring) whose first call is the same:
    (its length, the rank it starts at)."""
    n = len(first)
    if len(set(first)) == 1:
        return n, 0
    best = (0, 0)
    for start in range(n):
        if first[start] == first[start - 1]:
            continue  # not the start of a run
        length = 1
        while length < n and first[(start + length) % n] == first[start]:
            length += 1
        best = max(best, (length, start))
    return best


def _refuse_serialised_steps(cases, traffic, n: int) -> None:
    """Part 3's contract: no step's transfers wait for one another around the ring. With gloo a
    send goes out only once its receiver has posted the receive (gloo/transport/tcp/pair.cc,
    ``Pair::send``), so a run of r neighbouring ranks that all send first (or all receive first)
    makes a chain of about r + 1 transfers, one after another. With N = 4 a run of N - 1 = 3 is
    a single rank doing the other order: each step then costs N transfer times, not two. (At
    N <= 3 every right order has a run of N - 1, so only N >= 4 is judged.)"""
    __tracebackhide__ = True
    if n < 4:
        return
    for (shape, _, _), case in zip(cases, traffic):
        if int(np.prod(shape)) < n:
            continue
        calls = [[op for kind, op, _, _ in t["events"] if kind == "post"] for t in case]
        for step in range(2 * (n - 1)):
            first = [c[2 * step] if len(c) > 2 * step else None for c in calls]
            if None in first:
                return
            run, start = _longest_same_run(first)
            if run >= n - 1:
                ranks = [(start + j) % n for j in range(run)]
                other = [r for r in range(n) if r not in ranks]
                verb = "dist.send" if first[start] == "send" else "dist.recv"
                fail(f"your ring finished without a deadlock, but not in parallel: in step "
                     f"{step + 1} on {n} ranks, ranks {', '.join(map(str, ranks))} all called "
                     f"{verb} first and only rank {other[0]} the other way round. A gloo send "
                     f"goes out only once its receiver is in dist.recv, so that step's {n} "
                     f"transfers ran one after another around the ring: about {n} transfer "
                     f"times per step instead of two, and the ring's time grows with N like "
                     f"the naive all-reduce's.",
                     fix="choose the order so that no long run of neighbouring ranks makes the "
                         "same first call: then each step's sends find their receivers waiting "
                         "at once, whatever N.")
        return  # one case of length >= N shows the order of every step


DRY_SIZES = (5, 7, 8, 16)  # part 3's order of calls is modelled on these group sizes too


def _refuse_growing_steps(dry, per_step: dict) -> dict:
    """Part 3's contract: a step takes about the same time whatever N. ``dry`` is
    :func:`_dry_orders`'s answer for :data:`DRY_SIZES`; each size's order of calls is run
    through :func:`_rounds` (one time unit per transfer, a gloo send waiting for its receiver).
    A rule that deadlocks on a larger group (odd ones too) is named; so is one whose time per
    step grows from the smallest to the largest of them, 5 to 16 ranks, by more than half a
    transfer (the rules that keep the contract do not grow: even/odd 2.5 on 5 and 2.0 on 16,
    "the first half of the ranks send first" 2.6 and 2.2). Returns ``{N: transfer times per step}`` (empty when the order could not be found)."""
    __tracebackhide__ = True
    if not isinstance(dry, dict):
        return {}  # the ring needs more than send/recv/rank/size: its order is not judged
    modelled = {}
    for n, orders in dry.items():
        units, waiting = _rounds(orders)
        if units is None:
            firsts = {orders[r][0][0] if orders[r] else None for r in waiting}
            how = (f"all call dist.{firsts.pop()} first" if len(firsts) == 1 else
                   "wait for calls their neighbours never make")
            fail(f"your ring is right on {', '.join(map(str, sorted(per_step)))} ranks, but run "
                 f"with {n} ranks (its calls found without sending anything) its order of calls "
                 f"deadlocks: ranks {_ranks_text(waiting)} {how}. The contract asks for every "
                 f"N >= 2, and the rule that decides who sends first is the place to look.",
                 fix="decide the order from the rank (and N) so that, for every N, both kinds "
                     "of rank exist and alternate around the ring as far as N allows.")
        modelled[n] = units / (2 * (n - 1))
    small, large = min(modelled), max(modelled)
    if modelled[large] > modelled[small] + 0.5:
        orders = dry[large]
        first = [o[0][0] if o else None for o in orders]
        senders = [r for r in range(large) if first[r] == "send"]
        receivers = [r for r in range(large) if first[r] == "recv"]
        steady = all(o[k][0] == o[0][0] and o[k + 1][0] == o[1][0]
                     for o in orders if len(o) >= 2 for k in range(0, len(o) - 1, 2))
        few = min(len(senders), len(receivers))
        cap = (f" A transfer needs a rank in dist.send and its right neighbour in dist.recv, "
               f"and in your ring each rank keeps its order in every step, so no more than "
               f"{few} transfer{'s' if few > 1 else ''} can run at once: the other "
               f"{large - few} of a step's {large} wait their turn." if steady and few else "")
        costs = [f"{v:.1f} on {n}" for n, v in {**per_step, **modelled}.items()]
        fail(f"your ring is right, but its time per step grows with N. Counting each transfer "
             f"as one time unit and a send as waiting for its receiver's dist.recv (gloo's "
             f"rule), the order of its calls costs about {costs[0]} ranks, "
             f"{', '.join(costs[1:-1])} and {costs[-1]} transfer times per step on average "
             f"(the whole ring's time, until its last transfer ended, divided by its 2(N-1) "
             f"steps; on {', '.join(map(str, list(modelled)[:-1]))} and {large} ranks found by "
             f"running your code with stand-ins that only note the calls). On {large} ranks, "
             f"{len(senders)} rank(s) ({_ranks_text(senders)}) call dist.send first in step 1 "
             f"and {len(receivers)} call dist.recv first.{cap} The contract asks for a time "
             f"per step, on average, that does not grow with N: under a bound that does not "
             f"depend on N.",
             fix="choose the rule so that the number of ranks that send first, and the number "
                 "that receive first, both grow with N (about half each), spread around the "
                 "ring: then about N/2 transfers run at once, whatever N.")
    return modelled


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    return ", ".join(map(str, ranks)) if len(ranks) <= 6 else (
        f"{', '.join(map(str, ranks[:4]))}, …, {ranks[-1]}")


# --- part 3's prediction: the time per step of the learner's own order on odd N ----------------

STEP_QUESTION = "your order's transfer times per step on average, N = {n}"
STEP_SIZES = (3, 5)     # predicted
STEP_SHOWN = (3, 5, 7, 4, 8)  # modelled for the explanation: odd, then even for contrast


def _step_model(fn, sizes):
    """``{N: (whole ring's transfer times, per step, first calls of step 1)}`` for the order
    ``fn`` makes its calls in (a dry run, :func:`_dry_orders`), or a string saying why none."""
    dry = _dry_orders(fn, sizes)
    if not isinstance(dry, dict):
        return dry
    out = {}
    for n, orders in dry.items():
        units, _ = _rounds(orders)
        first = [o[0][0] if o else None for o in orders]
        out[n] = (units, None if units is None else units / (2 * (n - 1)), first)
    return out


def check_step_prediction(guesses, fn) -> None:
    """Compare the learner's predictions of their own order's time per step (transfer times,
    on average) on 3 and 5 ranks with the model run on the order their ``ring_allreduce`` makes
    its calls in, and explain the gap: a rank makes its 4(N-1) calls one after another, so 2
    per step is the floor; where two neighbouring ranks make the same first call (on odd N any
    rule that alternates has such a seam) one waits for the other, and because ranks do not
    wait for one another between steps that delay is paid once, a fixed number of transfer
    times spread over 2(N-1) steps: even/odd costs 4N in all on odd N, 3 per step on 3 ranks,
    2.5 on 5, 2.33 on 7 (and 2 on every even N). ``guesses`` is ``{N: Prediction}``, from
    ``predict(..., STEP_QUESTION.format(n=N), ...)``; a wrong prediction never raises."""
    from dpcourse.checks import Prediction, reveal

    __tracebackhide__ = True
    if not isinstance(guesses, dict) or not all(
            isinstance(guesses.get(n), Prediction) for n in STEP_SIZES):
        fail(f"check_step_prediction needs your predictions as a dict {{3: ..., 5: ...}} of "
             f"what predict(...) returned, got {guesses!r}.")
    model = _step_model(fn, STEP_SHOWN)
    if not isinstance(model, dict):
        fail(f"the order of your ring's calls could not be found by running it with stand-ins "
             f"({model}): run check_ring_allreduce first.")
    if any(model[n][0] is None for n in STEP_SHOWN):
        stuck = [n for n in STEP_SHOWN if model[n][0] is None]
        fail(f"your ring's order of calls deadlocks on {stuck} ranks: run check_ring_allreduce "
             f"first, and make it pass.")
    per = {n: model[n][1] for n in STEP_SHOWN}
    extra = {n: model[n][0] - 4 * (n - 1) for n in STEP_SHOWN}
    odd = [n for n in STEP_SHOWN if n % 2]
    first5 = model[5][2]
    seams = [(r, (r + 1) % 5) for r in range(5) if first5[r] == first5[(r + 1) % 5]]
    seam = ""
    if seams:
        a, b = seams[0]
        verb = "dist.send" if first5[a] == "send" else "dist.recv"
        seam = (f" On 5 ranks your ranks {a} and {b}, neighbours, both call {verb} first in step "
                f"1, so one of them waits for the other before its first transfer can start"
                + (" (an odd ring cannot alternate all the way round: some two neighbours "
                   "always match)." if len(seams) == 1 else
                   f"; {len(seams)} such pairs of neighbours make chains, each rank waiting for "
                   f"the next."))
    paid = ("the same few transfer times on every odd N: a delay paid once, not in every "
            "step, because a rank that has finished a step goes on without waiting for the "
            "others, so the delay is carried along the ring and overlapped by later steps"
            if len({extra[n] for n in odd}) == 1 else
            "a start-up delay that grows with the longest chain of neighbours making the same "
            "first call, paid once, not in every step")
    even_free = all(extra[n] == 0 for n in STEP_SHOWN if not n % 2)
    explanation = (
        f"A rank makes its 4(N - 1) calls one after another, each at least one transfer time, "
        f"so 2 per step on average is the floor. Your order's whole ring takes "
        f"{', '.join(f'{model[n][0]} on {n}' for n in odd)} ranks: "
        f"{', '.join(f'{extra[n]}' for n in odd)} "
        f"transfer times more than 4(N - 1) — {paid}.{seam} Spread over 2(N - 1) steps that is "
        f"{', '.join(f'{per[n]:.2f} on {n}' for n in odd)} ranks per step: more steps share the "
        f"extra as N grows, so the average falls, and on even N "
        f"({', '.join(f'{per[n]:.2f} on {n}' for n in STEP_SHOWN if not n % 2)}) there "
        f"{'is no such delay' if even_free else 'is less of it'}.")
    for n in STEP_SIZES:
        guess = guesses[n]
        close = abs(float(guess.value) - per[n]) <= 0.05
        reveal(guess, round(per[n], 2), close=close, how="modelled",
               explanation=explanation if n == STEP_SIZES[-1] else "")
