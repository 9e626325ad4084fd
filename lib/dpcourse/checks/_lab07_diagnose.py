"""Lab 07 part 2's diagnosis: from what the spy recorded on every rank (each all-reduce's size,
storage and launch and wait times, each gradient's arrival) and the values the wrapper left,
one sentence naming what went wrong in a step. Used by
:func:`dpcourse.checks.lab07.check_bucketed_ddp`."""

from __future__ import annotations

import torch

from . import fail
from ._lab07_bench import _STEPS, _ZERO_GRAD, _all_close, _check_net, _close
from ._lab07_buckets import bucket_problem

def _diagnose(results: list, world_size: int, cap_mb: float) -> None:
    __tracebackhide__ = True
    r0 = results[0]
    names = r0["names"]
    buckets = r0["buckets"]
    if buckets is None:
        fail("the wrapper has no self.buckets list of lists of parameters: keep the buckets "
             "from assign_buckets in self.buckets.")
    if any(i == -2 for b in buckets for i in b):
        fail(f"self.buckets holds the frozen parameter {r0['frozen'][0]} (requires_grad=False): "
             f"it never gets a gradient, so its bucket would never be complete.",
             fix=("reconsider what a bucket waits for: a parameter that never gets a gradient "
                  "would keep its bucket from ever being complete."))
    if any(i < 0 for b in buckets for i in b):
        fail("self.buckets holds something that is not one of the model's parameters.")
    params = [p for p in _check_net().parameters() if p.requires_grad]
    problem = bucket_problem([[params[i] for i in b] for b in buckets], params, cap_mb)
    if problem:
        fail(f"self.buckets is wrong at {cap_mb} MiB: {problem}", fix=problem.fix)
    numels = r0["numels"]
    for rank, r in enumerate(results):
        for step, s in enumerate(r["steps"]):
            prev = r["steps"][step - 1] if step else None
            _diagnose_step(s, prev, step, rank, world_size, buckets, names, numels)
    for rank, r in enumerate(results):
        if not torch.allclose(r["params"], r["ddp"], rtol=1e-4, atol=1e-6):
            fail(f"every step's gradients were right, but after {_STEPS} steps rank {rank}'s "
                 f"weights differ from DDP's: something in the wrapper changed the weights.",
                 fix="reconsider what your wrapper touches besides the gradients.")


def _bucket_of_call(calls, buckets, numels) -> list:
    """The bucket each call carried: by its size (the check's buckets all differ in size)."""
    by_size = {sum(numels[i] for i in b): k for k, b in enumerate(buckets)}
    return [by_size.get(c["numel"]) for c in calls]


def _diagnose_step(s, prev, step, rank, world_size, buckets, names, numels) -> None:
    __tracebackhide__ = True
    calls = s["calls"]
    n_params = len(names)
    when = f"in step {step + 1}" + (f" on rank {rank}" if rank else "")
    bucket_numels = sorted(sum(numels[i] for i in b) for b in buckets)
    # 1. How many all-reduces, and how large.
    if not calls:
        if step > 0:
            fail(f"no all-reduce was launched {when}, after a first step that had them: what "
                 f"the wrapper remembered from the first step still said every bucket was "
                 f"launched.",
                 fix=("reconsider what the hooks remember: is it as it was before the first "
                      "backward when the next one begins?"))
        fail("the check saw no dist.all_reduce call: launch it as dist.all_reduce(buffer, "
             "async_op=True) from the hook (the check counts calls made through "
             "torch.distributed).")
    sync_in_backward = [c for c in calls if not c["async"] and c["t_launch"] < s["backward_end"]]
    if sync_in_backward:
        fail("the hook calls a blocking all_reduce (no async_op=True): the backward stops until "
             "each bucket has crossed the wire, so nothing overlaps.",
             fix=("reconsider what the backward does while a blocking call waits, and who else "
                  "could wait instead (lesson 07 §2)."))
    if len(calls) != len(buckets):
        if len(calls) == n_params:
            fail(f"{len(calls)} all-reduces {when}, one per parameter, for {len(buckets)} "
                 f"buckets.", fix=("reconsider what a bucket is for: how many messages should "
                                   "it cost?"))
        fail(f"{len(calls)} all-reduces {when} for {len(buckets)} buckets.",
             fix=("reconsider when your hooks decide to launch, and what they remember was "
                  "launched already."))
    if sorted(c["numel"] for c in calls) != bucket_numels:
        fail(f"the all-reduces {when} carried {sorted(c['numel'] for c in calls)} elements; "
             f"the buckets hold {bucket_numels}.",
             fix=("reconsider what one bucket's message is: which tensor holds all of its "
                  "gradients?"))
    # 2. In which order, and when, they were launched; when they were waited on.
    order = _bucket_of_call(calls, buckets, numels)
    if order != sorted(order):
        k = next(j for j in range(len(order)) if order[j] != sorted(order)[j])
        fail(f"bucket {order[k]} was launched before bucket {sorted(order)[k]} {when}: buckets "
             f"filled out of order (this model registers its output layer before the hidden "
             f"layer it follows) and you launched each as it filled, so the i-th all-reduce "
             f"need not be the same bucket on every rank.",
             fix=("reconsider what must hold for the i-th all-reduce to be the same bucket on "
                  "every rank, whatever order this rank's gradients came in (lesson 07 §3, "
                  "in-order launch)."))
    arrivals = sorted(s["ready"].values())
    for k, b in enumerate(buckets):
        launched_at = calls[order.index(k)]["t_launch"]
        arrived = sum(1 for i in b if s["ready"][i] < launched_at)
        if arrived < len(b):
            stale = "" if _ZERO_GRAD[step] else (
                f" This step began with zero_grad(set_to_none=False): every p.grad existed "
                f"already (the step before's tensor, zeroed in place), so a p.grad that is not "
                f"None says nothing about whether its gradient has arrived in this backward.")
            fail(f"bucket {k} was launched {when} after {arrived} of its {len(b)} gradients had "
                 f"arrived in this step ({launched_at:.2f} ms into the step; its last gradient "
                 f"arrived at {max(s['ready'][i] for i in b):.2f} ms): its all-reduce summed a "
                 f"buffer whose gradients were still to come, so the ranks averaged something "
                 f"that is not this step's gradient.{stale}",
                 fix=("reconsider how your hook knows that a bucket's gradients have all "
                      "arrived in THIS backward, whatever zero_grad left in p.grad."))
    if all(c["t_launch"] >= s["backward_end"] for c in calls):
        fail("every all-reduce was launched after the backward had finished (in "
             "finish_gradient_synchronization): nothing overlaps the backward.",
             fix=("reconsider where the overlap comes from: which code runs while the backward "
                  "is still going (lesson 07 §2)?"))
    launchable = 0.0
    late = []
    for k, b in enumerate(buckets):
        launchable = max(launchable, max(s["ready"][i] for i in b))
        launch_k = calls[order.index(k)]["t_launch"]
        missed = [t for t in arrivals if launchable < t < launch_k]
        if missed:
            late.append((k, launchable, launch_k, len(missed)))
    if late:
        if all(c["t_launch"] >= arrivals[-1] for c in calls):
            fail(f"every bucket was launched only when the backward's last gradient had arrived "
                 f"({arrivals[-1]:.2f} ms into the step) {when}: nothing overlapped the "
                 f"backward.", fix=("reconsider where the overlap comes from: launching from a "
                                    "hook is not enough if the hook waits for the last "
                                    "gradient."))
        k, ready_at, launched, missed = late[0]
        fail(f"bucket {k} could go at {ready_at:.2f} ms {when} (its last gradient had arrived "
             f"and every earlier bucket had been launched) but was launched at {launched:.2f} "
             f"ms, after {missed} more gradient(s) had arrived.",
             fix=("reconsider which hook call is the first at which that bucket may go, and "
                  "whether your hook looks at it then."))
    waited_early = [c for c in calls if c["async"] and c["t_wait"] is not None
                    and not c["future"] and c["t_wait"] < s["backward_end"]]
    if waited_early:
        fail("you waited on each all-reduce inside the hook (work.wait() before the backward "
             "had finished): the backward stalls until each bucket has crossed the wire, so "
             "nothing overlaps.",
             fix=("reconsider where the waiting belongs so that the backward never stands still "
                  "(lesson 07 §2)."))
    unwaited = [c for c in calls if c["async"] and c["t_wait"] is None and not c["future"]]
    if unwaited:
        fail(f"finish_gradient_synchronization() returned while {len(unwaited)} of "
             f"{len(calls)} all-reduces had not been waited on: optimizer.step() would read "
             f"gradients the all-reduce may still be writing (a race).",
             fix=("reconsider which of the all-reduces you launched are known to have finished "
                  "when the optimizer reads the gradients."))
    if s["stale_waits"]:
        fail(f"{when}, finish_gradient_synchronization() waited again on "
             f"{len(s['stale_waits'])} handle(s) from step {s['stale_waits'][0] + 1}: the list "
             f"of handles grows by one per bucket every step.",
             fix=("reconsider what of this step your wrapper still holds when the next one "
                  "begins."))
    # 3. The gradients left for optimizer.step(): their values, then where they live.
    after, own, mean = s["after"], s["own"], s["mean"]
    if any(a is None for a in after):
        missing = [names[i] for i, a in enumerate(after) if a is None]
        fail(f"p.grad is None for {missing[:3]} after finish_gradient_synchronization() {when}, "
             f"so the optimizer would skip them.",
             fix="reconsider what the contract wants p.grad to be when the step ends.")
    for i, (a, m) in enumerate(zip(after, mean)):
        if a.shape != m.shape:
            fail(f"{names[i]}.grad has shape {tuple(a.shape)} instead of {tuple(m.shape)}.",
                 fix="reconsider what shape the optimizer expects p.grad to have.")
    if _all_close(after, mean):
        _diagnose_views(s, when, buckets, names, order, calls)
        return
    _diagnose_values(s, prev, step, when, world_size, buckets, names, numels)


def _diagnose_views(s, when, buckets, names, order, calls) -> None:
    """The values are right: are the gradients views of the buffers that were all-reduced?"""
    __tracebackhide__ = True
    for k, b in enumerate(buckets):
        c = calls[order.index(k)]
        for i in b:
            storage, offset, numel = s["views"][i]
            if storage != c["storage"]:
                fail(f"{names[i]}.grad holds the right average {when} but is not a view of its "
                     f"bucket's buffer: it was copied back (or copied in and never pointed at "
                     f"the bucket), so the contract's views, and the memory they save, are "
                     f"missing.",
                     fix=("reconsider what DDP's gradient_as_bucket_view promises (lesson 07 "
                          "§3, gradients as views): where autograd writes, and what the "
                          "all-reduced buffer then is."))


def _overlapping_views(s, buckets, names):
    spans = {}
    for b in buckets:
        for i in b:
            storage, offset, numel = s["views"][i]
            spans.setdefault(storage, []).append((offset, offset + numel, i))
    for group in spans.values():
        group.sort()
        for (a0, a1, i), (b0, b1, j) in zip(group, group[1:]):
            if b0 < a1:
                return names[i], names[j], a0, b0
    return None


def _never_put_in(s, step, when, world_size, buckets, numels, rebound: bool = False) -> None:
    """p.grad is this rank's own gradient (or, ``rebound``, its bucket's view): did that
    gradient ever reach its bucket? A bucket that went on the wire without it (zeros, or an
    earlier step's values) means the hook trusted a view set once, which a fresh tensor from
    autograd (set_to_none=True) is not — or pointed p.grad back at the view and dropped the
    fresh tensor."""
    __tracebackhide__ = True
    order = _bucket_of_call(s["calls"], buckets, numels)
    for k, b in enumerate(buckets):
        sent = s["calls"][order.index(k)].get("sent") if k in order else None
        if sent is None or (rebound and any(s["views"][i][0] != s["calls"][order.index(k)]
                                            ["storage"] for i in b)):
            continue
        own = torch.cat([s["own"][i].reshape(-1) for i in b]).sort().values
        carried = sent.reshape(-1).sort().values
        if any(torch.allclose(carried, o, rtol=1e-4, atol=1e-7)
               for o in (own, own / world_size)):
            continue
        held = "zeros" if not carried.any() else "other values (an earlier step's)"
        fresh = (f" This step began with zero_grad(set_to_none=True): autograd then hands the "
                 f"hook a fresh tensor, outside the bucket, so a view made p.grad once (in "
                 f"__init__, or in an earlier step) is not where this gradient is."
                 if _ZERO_GRAD[step] else "")
        if rebound:
            fail(f"p.grad is its bucket's view after finish_gradient_synchronization() {when}, "
                 f"but bucket {k} went on the wire holding {held}, not this backward's "
                 f"gradients: your hook pointed p.grad at the view without putting the gradient "
                 f"it was handed into it, so that gradient was dropped.{fresh}",
                 fix=("reconsider what autograd hands the hook after each kind of zero_grad, "
                      "and what becomes of it when p.grad is pointed elsewhere (lesson 07 §3, "
                      "gradients as views; part 2's hint 2)."))
        fail(f"p.grad holds this rank's own gradient after finish_gradient_synchronization() "
             f"{when}, and bucket {k} went on the wire holding {held}, not this backward's "
             f"gradients: your hook never put the gradient it was handed into the bucket.{fresh}",
             fix=("reconsider what autograd hands the hook after each kind of zero_grad, and how "
                  "the hook can tell (lesson 07 §3, gradients as views; part 2's hint 2)."))


def _diagnose_values(s, prev, step, when, world_size, buckets, names, numels) -> None:
    __tracebackhide__ = True
    after, own, mean, calls = s["after"], s["own"], s["mean"], s["calls"]
    if any(torch.isnan(a).any() for a in after):
        bad = next(names[i] for i, a in enumerate(after) if torch.isnan(a).any())
        fail(f"{bad}.grad was read from its bucket before wait() {when}: the check leaves a "
             f"buffer whose all-reduce is in flight without a defined value (NaN), as a GPU "
             f"collective still writing it would — copying back before wait() copies garbage.",
             fix=("reconsider what a buffer holds while its all-reduce is in flight, and what "
                  "the views of the contract make unnecessary."))
    temporary = [c for c in calls if c["async"] and not c["kept"]]
    if temporary:
        fail(f"{len(temporary)} of the {len(calls)} all-reduces {when} were of a temporary "
             f"tensor that neither your wrapper nor any p.grad keeps (torch.cat, .clone(), "
             f"buffer / world_size, ... make a new tensor): its result is thrown away.",
             fix=("reconsider which tensor the all-reduce must sum so that its result is the "
                  "one the gradients read."))
    clash = _overlapping_views(s, buckets, names)
    if clash:
        a, b, oa, ob = clash
        fail(f"the views of {a} (offset {oa}) and {b} (offset {ob}) overlap in their bucket's "
             f"buffer {when}: both gradients are written into the same numbers.",
             fix="reconsider how the slices of one buffer tile it: where does each one start?")
    for i, b in enumerate(buckets):
        for j in b:
            storage = s["views"][j][0]
            home = [c["storage"] for c in calls if c["numel"] == sum(numels[x] for x in b)]
            others = [c["storage"] for c in calls if c["storage"] != (home[0] if home else None)]
            if home and storage != home[0] and storage in others:
                fail(f"{names[j]}.grad is a view of another bucket's buffer {when}.",
                     fix="reconsider which buffer each parameter's slice is cut from.")
    total = [m * world_size for m in mean]
    if _all_close(after, total) and (step == 0 or prev is None or world_size != 2
                                     or not _all_close(prev["after"], prev["mean"])):
        fail(f"the gradients hold the sum over the ranks, {world_size} times the mean, {when}.",
             fix=("reconsider what an all-reduce with SUM gives, and what the contract asks "
                  "p.grad to hold."))
    if _all_close(after, [2 * m for m in mean]):
        fail(f"the gradients are twice the mean {when}, after a right step 1: p.grad was "
             f"already the bucket's view, and adding it onto itself (view.add_(p.grad)) "
             f"doubled it.", fix=("reconsider the two cases a hook meets: autograd accumulated "
                                  "into the view already, or handed a fresh tensor — and what "
                                  "each needs (lesson 07 §3, gradients as views)."))
    if prev is not None and _all_close(after, [m + q for m, q in zip(mean, prev["mean"])]):
        fail(f"the gradients {when} are this step's mean plus the last step's: a fresh p.grad "
             f"(after zero_grad(set_to_none=True)) was added (add_) to the bucket, which still "
             f"held the last average.", fix=("reconsider what the bucket still holds from the "
                                             "last step when a fresh gradient arrives (lesson "
                                             "07 §3, gradients as views)."))
    for k in sorted({2, 3, 4} - {world_size}):
        if _all_close(after, [t / k for t in total]):
            fail(f"on {world_size} ranks the gradients are the sum divided by {k}, a fixed "
                 f"number that is not this group's size.",
                 fix=("reconsider where the number you divide by comes from: this group's size, "
                      "whatever it is."))
    for extra, what in ((own, "its own gradient"), ([o / world_size for o in own],
                                                    "its own gradient divided by the world size")):
        if _all_close(after, [m + e for m, e in zip(mean, extra)]):
            fail(f"p.grad holds the mean plus {what} {when}: the average was added (add_) to "
                 f"the gradient instead of replacing it.",
                 fix=("reconsider whether anything needs copying back at all, once p.grad is "
                      "the averaged buffer."))
    if _all_close(after, own) or _all_close(after, [o / world_size for o in own]):
        _never_put_in(s, step, when, world_size, buckets, numels)
        fail(f"p.grad still holds this rank's own gradient after finish_gradient_"
             f"synchronization() {when}, while the bucket holds the average: p.grad is not "
             f"the bucket's view (autograd's fresh gradient was copied in but p.grad never "
             f"pointed at the view).", fix=("reconsider which tensor the optimizer reads: is "
                                            "p.grad the buffer that was averaged?"))
    _never_put_in(s, step, when, world_size, buckets, numels, rebound=True)
    wrong = [i for i, (a, m) in enumerate(zip(after, mean)) if not _close(a, m)]
    for i in wrong:
        others = [j for j in range(len(names)) if j != i and numels[j] == numels[i]
                  and _close(after[i].reshape(-1), mean[j].reshape(-1))]
        if others:
            fail(f"{names[i]}.grad holds the averaged gradient of {names[others[0]]} {when}: it "
                 f"was given the wrong slice of the bucket.",
                 fix="reconsider how each parameter finds its slice of the bucket.")
    for b in buckets:
        got = torch.cat([after[i].reshape(-1) for i in b])
        right = torch.cat([mean[i].reshape(-1) for i in b])
        if any(i in wrong for i in b) and torch.allclose(got.sort().values, right.sort().values,
                                                         rtol=1e-4, atol=1e-7):
            fail(f"bucket {buckets.index(b)} holds the right averages {when}, but in the wrong "
                 f"parameters: {names[next(i for i in b if i in wrong)]}.grad was given another "
                 f"offset of the buffer than the one its gradient went in at.",
                 fix=("reconsider whether the way in and the way out of the bucket use the same "
                      "slice — or whether one view could serve both."))
    order = _bucket_of_call(calls, buckets, numels)
    k = next(j for j, b in enumerate(buckets) if wrong[0] in b)
    c = calls[order.index(k)] if k in order else None
    seen = "" if c is None else (
        f" What the check saw of its bucket {k}: its {len(buckets[k])} gradients had all "
        f"arrived by {max(s['ready'][i] for i in buckets[k]):.2f} ms into the step, its "
        f"all-reduce was launched at {c['t_launch']:.2f} ms" + (
            f" and waited on at {c['t_wait']:.2f} ms" if c["t_wait"] is not None else "") +
        ", so the bucket was complete when it went and the timing is not the cause: what "
        "was in the buffer that went, what was done to it, or where this gradient's view lies "
        "in it is.")
    fail(f"{names[wrong[0]]}.grad is not the mean over the ranks {when} (nor the sum, nor this "
         f"rank's own gradient, nor any single mistake the check knows).{seen}",
         fix=("reconsider, bucket by bucket, what went into its buffer before the all-reduce, "
              "what was done to it, and where each gradient's view lies in it (lesson 07 §3's "
              "picture)."))
