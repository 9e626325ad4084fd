"""The stretch of lab 07, the parts its check runs and reads: the probe model whose gradients
the check chooses, the worker that runs the learner's communication hook inside real DDP and
records every call, the replay of top-k with error feedback (and of its plausible mistakes),
and the diagnosis that turns the record into the one sentence naming the mistake.

:mod:`dpcourse.checks.lab07` holds the public ``check_topk_hook``; kept apart so that each
file holds one part of the lab, readable top to bottom.
"""

from __future__ import annotations

import re
import time

import torch
from torch import nn

from .. import launch
from . import fail, run_ranks


# --------------------------------------------------------------------------------------------
# Stretch: a top-k communication hook with error feedback
# --------------------------------------------------------------------------------------------
#
# The learner's hook runs inside real DDP on a probe model whose gradients the check chooses:
# the loss is sum(w * c), so each rank's gradient is exactly its c, a fixed pattern plus a
# little noise that changes every step. Every hook call is recorded (the bucket DDP handed in,
# the tensor the learner's future delivered) and every collective the hook launches is
# weighed. The parent then replays top-k with error feedback on the recorded buckets, rank by
# rank, and compares. When the learner's results differ it replays the plausible wrong hooks
# too (no error feedback, top-k by value, residual never cleared, ...) and names the one that
# matches: a diagnosis by reproduction, not by guessing from symptoms.

HOOK_WORLD_SIZES = (2, 3)
HOOK_FRACTION = 0.05
_HOOK_SIZES = (700, 300, 130)     # three parameters: three buckets after DDP's rebuild
_HOOK_CAP_MB = 0.0003   # DDP closes a bucket once it reaches the cap: 1 bucket, then 3
_HOOK_STEPS = 12
# What one selected entry may cost on the wire: its value in the gradient's dtype (float32, 4
# bytes) and its index as topk returns it (int64, 8 bytes). A value widened to float64 (16 per
# entry) or an entry sent twice is refused as waste; int32 indices or a packed message pass.
_SENT_PER_ENTRY = 12
# Asynchrony: on these steps every rank but 0 pauses between its forward and its backward, so
# rank 0's collectives cannot complete before its hook returns — unless the hook waited for
# them. A hook whose future was already complete on every call, on every rank, blocked.
_STAGGER_STEPS = (1, 4, 7, 10)
_STAGGER_S = 0.03


class _Probe(nn.Module):
    def __init__(self, sizes=_HOOK_SIZES):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in sizes])

    def forward(self, cs):
        return sum((w * c).sum() for w, c in zip(self.ws, cs))


def _probe_gradients(rank: int, step: int, sizes=_HOOK_SIZES) -> list:
    """A common pattern (magnitudes 0.2–1, random signs, so large *negative* entries exist),
    a rank's own part (ranks agree on some large entries, not all) and fresh noise each step."""
    out = []
    for j, n in enumerate(sizes):
        g0 = torch.Generator().manual_seed(1000 + j)
        common = (0.2 + 0.8 * torch.rand(n, generator=g0)) * torch.where(
            torch.rand(n, generator=g0) < 0.5, -1.0, 1.0)
        own = 0.5 * torch.randn(n, generator=torch.Generator().manual_seed(2000 + 10 * rank + j))
        noise = 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(
            3000 + 1000 * step + 10 * rank + j))
        out.append(common + own + noise)
    return out


class _HookRaised(RuntimeError):
    """The learner's hook raised; the message carries what it raised."""


def _topk_worker(rank: int, world_size: int, hook, state_cls, fraction: float,
                 cap_mb: float = _HOOK_CAP_MB, sizes=_HOOK_SIZES) -> dict:
    __tracebackhide__ = True
    import traceback

    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..collectives import record_collectives

    model = DDP(_Probe(sizes), bucket_cap_mb=cap_mb)
    state = state_cls(fraction)
    calls, sent, problems, step_now = [], [0] * _HOOK_STEPS, [], [0]
    blocking, in_hook, works_now = [], [False], []

    def count(call):                    # what this rank hands to each collective
        sent[step_now[0]] += call.nbytes
        if in_hook[0] and not call.async_op and call.function not in blocking:
            blocking.append(call.function)

    def launched(call):                 # the futures of the works this hook call launched
        if in_hook[0] and call.async_op and hasattr(call.result, "get_future"):
            try:
                works_now.append(call.result.get_future())
            except RuntimeError:        # a backend without futures: nothing to judge
                pass

    def spy_hook(hook_state, bucket):
        buf = bucket.buffer()
        rec = {"step": step_now[0], "index": bucket.index(), "input": buf.detach().clone(),
               "output": None}
        calls.append(rec)
        in_hook[0] = True
        works_now.clear()
        try:
            fut = hook(hook_state, bucket)
        except Exception as exc:
            problems.append(("raised", "".join(
                traceback.format_exception_only(type(exc), exc)).strip()))
            raise
        finally:
            in_hook[0] = False
        rec["done_at_return"] = isinstance(fut, torch._C.Future) and fut.done()
        # A future already complete while a collective the hook launched is still in flight:
        # its value was built before the other ranks' entries had arrived.
        rec["built_in_flight"] = rec["done_at_return"] and any(
            not f.done() for f in works_now)
        works_now.clear()
        done = torch.futures.Future()
        if not isinstance(fut, torch._C.Future):
            problems.append(("not_future", type(fut).__name__))
            done.set_result(buf)
            return done

        def delivered(f):
            value = f.value()
            if isinstance(value, (list, tuple)):
                problems.append(("list", f"{type(value).__name__} of {len(value)}"))
            elif not isinstance(value, torch.Tensor):
                problems.append(("not_tensor", type(value).__name__))
            elif value.shape != buf.shape or value.dtype != buf.dtype:
                problems.append(("shape", (tuple(value.shape), str(value.dtype),
                                           tuple(buf.shape), str(buf.dtype))))
            else:
                rec["output"] = value.detach().clone()
                return value
            return buf

        return fut.then(delivered)

    model.register_comm_hook(state, spy_hook)
    with record_collectives(before=count, after=launched):
        for step in range(_HOOK_STEPS):
            step_now[0] = step
            model.zero_grad(set_to_none=True)
            try:
                loss = model(_probe_gradients(rank, step, sizes))
                if rank > 0 and step in _STAGGER_STEPS:
                    time.sleep(_STAGGER_S)
                loss.backward()
            except Exception as exc:
                if problems and problems[-1][0] == "raised":
                    raise _HookRaised(problems[-1][1]) from None
                raise
            if problems:
                break
    return {"calls": calls, "sent": sent, "problems": problems, "blocking": blocking}


def _topk_replay(inputs: list, world_size: int, k_of, *, feedback=True, magnitude=True,
                 clear=True, select_corrected=True, add=True, scale=None, k_shift=0,
                 residual_from_grad=False) -> list:
    """Top-k with error feedback replayed on the recorded buckets: ``inputs[r]`` is rank r's
    list of (index, gradient) hook calls. The keywords switch on one plausible mistake each.
    Returns the averaged tensor each call should have produced."""
    __tracebackhide__ = True
    residuals = [{} for _ in range(world_size)]
    outputs = []
    for j in range(len(inputs[0])):
        index, g0 = inputs[0][j]
        out = torch.zeros_like(g0)
        for r in range(world_size):
            g = inputs[r][j][1]
            res = residuals[r].get(index)
            if res is None or res.shape != g.shape:      # DDP rebuilt its buckets
                res = torch.zeros_like(g)
            corrected = g + res if feedback else g.clone()
            key = corrected if select_corrected else g
            key = key.abs() if magnitude else key
            k = max(1, min(g.numel(), k_of(g.numel()) + k_shift))
            idx = key.topk(k).indices
            if add:
                out.index_add_(0, idx, corrected[idx])
            else:
                out[idx] = corrected[idx]
            left = (g if residual_from_grad else corrected).clone()
            if clear:
                left[idx] = 0
            residuals[r][index] = left
        outputs.append(out * (1.0 / world_size if scale is None else scale))
    return outputs


def _own_values_summed(inputs: list, world_size: int, k_of) -> tuple[list, list]:
    """The plausible mistake of an all-reduce of the k selected VALUES alone, replayed: every
    rank selects as top-k with error feedback does, the ranks' k values are summed position by
    position (the 1st with the 1st, ...), divided by the world size, and each rank puts that
    at its OWN k indices. Returns each rank's outputs and, per call, each rank's indices."""
    residuals = [{} for _ in range(world_size)]
    outputs, picked = [[] for _ in range(world_size)], []
    for j in range(len(inputs[0])):
        index, idxs, values = inputs[0][j][0], [], []
        for r in range(world_size):
            g = inputs[r][j][1]
            res = residuals[r].get(index)
            if res is None or res.shape != g.shape:      # DDP rebuilt its buckets
                res = torch.zeros_like(g)
            corrected = g + res
            idx = corrected.abs().topk(max(1, min(g.numel(), k_of(g.numel())))).indices
            idxs.append(idx)
            values.append(corrected[idx])
            left = corrected.clone()
            left[idx] = 0
            residuals[r][index] = left
        summed = sum(values) / world_size
        for r in range(world_size):
            out = torch.zeros_like(inputs[r][j][1])
            out[idxs[r]] = summed
            outputs[r].append(out)
        picked.append(idxs)
    return outputs, picked


def _own_values_problem(outputs: list, inputs: list, calls: list, world_size: int, k_of,
                        rank: int, j: int) -> tuple[str, str] | None:
    """The cause and fix if every rank's results are :func:`_own_values_summed`'s, else None;
    told with call ``j``, where rank 0 and ``rank`` differ."""
    replayed, picked = _own_values_summed(inputs, world_size, k_of)
    if not all(torch.allclose(o, e, rtol=1e-5, atol=1e-6)
               for r in range(world_size) for o, e in zip(outputs[r], replayed[r])):
        return None
    a, b = picked[j][0].tolist(), picked[j][rank].tolist()
    common = len(set(a) & set(b))
    shown = lambda xs: ", ".join(map(str, xs[:4])) + (", …" if len(xs) > 4 else "")
    return (f"step {calls[0][j]['step']}, bucket {calls[0][j]['index']}: rank 0 and rank {rank} "
            f"got different gradients because each rank's result is an all-reduce of the ranks' "
            f"k selected values alone, put back at that rank's own indices. Rank 0 selected "
            f"indices [{shown(a)}] and rank {rank} [{shown(b)}] ({common} of the k = {len(a)} "
            f"in common); an all-reduce adds position by position, so rank 0's value at index "
            f"{a[0]} was summed with rank {rank}'s at index {b[0]} — entries of different places "
            f"in the gradient. Each rank then put those sums at its own indices: the ranks "
            f"disagree, and neither holds the average.",
            ("reconsider what an all-reduce adds together when the ranks chose different "
             "indices, and which collective keeps each rank's list whole."))


# What a gloo rank reports when its peer has gone away (aborted or died) mid-collective.
_PEER_LOST = re.compile(launch.PEER_LOST.pattern + r"|Connection (reset|closed)|pair\.cc")


def _launch_hook(hook, state_cls, world_size: int, fraction: float, timeout: float) -> list:
    __tracebackhide__ = True
    def failed(exc) -> None:
        summary = exc.summary.removeprefix(f"{_HookRaised.__name__}: ")
        hint, fix = "", None
        if "size" in summary or "shape" in summary or "match" in summary:
            hint = (" — if it is the residual: DDP rebuilds its buckets after the first step, "
                    "so from the second step on bucket 0 holds other parameters, and another "
                    "number of them, than in the first")
            fix = ("reconsider what DDP's rebuild after the first step does to a bucket's size "
                   "(lesson 07 §6), and what the given TopKState does about it.")
        elif "died" in summary or _PEER_LOST.search(summary):
            # gloo aborts the rank that sees a size mismatch; its peer then reports a reset
            # connection, and whichever report arrives first is the one we see.
            hint = (" — gloo aborts a rank when the ranks' tensors in one collective differ in "
                    "size (its peer then sees the connection drop)")
            fix = "reconsider whether every rank's gathered tensors have the same size."
        what = "died in your hook" if "died" in summary else "raised in your hook"
        fail(f"rank {exc.rank} {what}: {summary}{hint}.", fix=fix)

    return run_ranks(_topk_worker, world_size, hook, state_cls, fraction, timeout=timeout,
                     failed=failed,
                     hang="every rank must make the same collectives in the same order, "
                          "whatever it selected, each with tensors of the same size on every "
                          "rank (k values and k indices).")


_PROBLEMS = {      # kind -> (cause, fix)
    "not_future": ("your hook returned a {} — DDP needs a torch.futures.Future whose value is "
                   "the averaged buffer, and waits on it only at the end of the backward.",
                   ("reconsider what DDP expects back from a hook: a value now, or a promise of "
                    "one (lesson 07 §5)?")),
    "list": ("your hook's future delivered a {} — DDP wants the tensor itself (the future of "
             "an all_reduce's work holds [tensor]).", ("reconsider what the future of a "
                                                       "collective's work holds, and what DDP "
                                                       "wants from yours.")),
    "not_tensor": ("your hook's future delivered a {}, not a tensor the size of "
                   "bucket.buffer().", None),
    "shape": ("your hook's future delivered a tensor of shape {0[0]} and {0[1]}, but the "
              "bucket is {0[2]} of {0[3]}: DDP copies that value into the gradients as it is.",
              ("reconsider what DDP does with your future's value: copies it into the gradients "
               "as it is.")),
}


def _diagnose_hook(results: list, world_size: int, k_of) -> None:
    __tracebackhide__ = True
    for r in results:
        for kind, detail in r["problems"]:
            cause, fix = _PROBLEMS[kind]
            fail(cause.format(detail), fix=fix)
    calls = [r["calls"] for r in results]
    outputs = [[c["output"] for c in rc] for rc in calls]
    inputs = [[(c["index"], c["input"]) for c in rc] for rc in calls]
    early = next(((rank, c) for rank, rc in enumerate(calls) for c in rc
                  if c.get("built_in_flight")), None)
    if early is not None:
        rank, c = early
        fail(f"step {c['step']}, bucket {c['index']}, rank {rank}: the future your hook returned "
             f"was already complete while a collective the hook had launched (async_op=True) "
             f"was still in flight, so its averaged tensor was built from output buffers the "
             f"other ranks' entries had not reached yet: whatever those buffers held (the ranks "
             f"then disagree, or an index is garbage). Launching the collectives was right; "
             f"reading their outputs before they arrive is the mistake.",
             fix=("reconsider when the gathered entries exist, and how a hook can hand DDP a "
                  "value that does not exist yet (lesson 07 §5; the stretch's hint 2)."))
    for j, out0 in enumerate(outputs[0]):
        step, index = calls[0][j]["step"], calls[0][j]["index"]
        for rank in range(1, world_size):
            if not torch.allclose(outputs[rank][j], out0, rtol=1e-5, atol=1e-6):
                summed = _own_values_problem(outputs, inputs, calls, world_size, k_of, rank, j)
                if summed:
                    fail(summed[0], fix=summed[1])
                own = all(torch.equal(outputs[r][j], inputs[r][j][1]) for r in range(world_size))
                why = ("each rank's future delivered its own gradient unchanged, so nothing "
                       "of the other ranks' entries reached it" if own else
                       "the averaged tensors the ranks built differ")
                fail(f"step {step}, bucket {index}: rank 0 and rank {rank} got different "
                     f"gradients: {why}, and replicas whose gradients differ drift apart.",
                     fix=("reconsider what every rank must learn of the others' choices so that "
                          "all build the same average."))
    for step in range(_HOOK_STEPS):
        numels = [c["input"].numel() for c in calls[0] if c["step"] == step]
        dense = sum(n * 4 for n in numels)
        budget = sum(_SENT_PER_ENTRY * k_of(n) + 64 for n in numels)
        sent = max(r["sent"][step] for r in results)
        if sent >= dense:
            fail(f"step {step}: a rank sent {sent} bytes for {dense} bytes of gradient, as much "
                 f"as the dense gradient itself (a tensor that is mostly zeros still travels "
                 f"whole), so the compression saved nothing.",
                 fix=("reconsider what the other ranks need to know of this rank's choice, and "
                      "which collective carries short lists that differ by rank."))
        if sent > budget:
            entries = sum(k_of(n) for n in numels)
            fail(f"step {step}: a rank sent {sent} bytes for the {entries} entries it selected, "
                 f"{sent / entries:.1f} bytes per entry, where a value in the gradient's dtype "
                 f"(float32, 4 bytes) and its int64 index (8) take {_SENT_PER_ENTRY}: whatever "
                 f"travels beyond that (a value widened to float64, an entry or a list sent "
                 f"twice) costs bandwidth and carries nothing the average needs.",
                 fix=("reconsider what each selected entry needs on the wire, and in which "
                      "dtype."))
    right = _topk_replay(inputs, world_size, k_of)
    if all(torch.allclose(o, e, rtol=1e-5, atol=1e-5) for o, e in zip(outputs[0], right)):
        _diagnose_asynchrony(results)
        return
    wrong = [
        (dict(feedback=False),
         "your results are top-k without error feedback: what a rank did not send is lost, "
         "so small gradients are never sent at all.",
         "reconsider what 'nothing is lost' asks of what a rank does not send."),
        (dict(magnitude=False),
         "you chose the k largest values, not the k largest magnitudes: large negative "
         "gradients are never sent.", ("reconsider what 'largest' must mean for a gradient "
                                       "entry that is large and negative.")),
        (dict(clear=False),
         "the residual still holds the values that were sent, so every step sends them again.",
         ("reconsider what the residual should hold after a call: what was sent, or what was "
          "not?")),
        (dict(select_corrected=False),
         "you chose the top k of this step's gradient alone, so what waited in the residual "
         "never gets its turn.", ("reconsider which tensor holds everything this rank could "
                                  "send now.")),
        (dict(residual_from_grad=True),
         "your residual is kept from this call's gradient (bucket.buffer()) with the sent "
         "entries zeroed, not from the corrected gradient: whatever was waiting in the old "
         "residual and was not sent this time is thrown away at every call, so a small entry "
         "still never gets its turn — nothing may be lost, only postponed.",
         "reconsider which tensor holds everything this rank could have sent at this call: "
         "what it keeps for later must be that tensor minus what it did send (hint 2 of the "
         "stretch)."),
        (dict(add=False),
         "where two ranks selected the same index, one value overwrote the other instead of "
         "both counting.", "reconsider what should happen at an index two ranks both chose."),
        (dict(scale=1.0),
         "you summed the ranks' values without averaging: the result is N times the average.",
         "reconsider what the contract's future must hold: a sum, or an average?"),
        (dict(scale=1.0 / world_size ** 2),
         "you divided by the world size twice.", ("reconsider how many times your average is "
                                                  "divided, and where.")),
        (dict(scale=0.5),
         "you divided by 2, a fixed number that is not this group's size.",
         ("reconsider where the number you divide by comes from: this group's size, whatever it "
          "is.")),
        (dict(k_shift=1), "you sent k + 1 entries.", ("reconsider how many entries state.k says "
                                                      "to send.")),
        (dict(k_shift=-1), "you sent k - 1 entries.", ("reconsider how many entries state.k "
                                                       "says to send.")),
    ]
    for kwargs, message, fix in wrong:
        if kwargs.get("scale") == 0.5 and world_size == 2:
            continue
        guess = _topk_replay(inputs, world_size, k_of, **kwargs)
        if all(torch.allclose(o, e, rtol=1e-5, atol=1e-5) for o, e in zip(outputs[0], guess)):
            fail(message, fix=fix)
    j = next(i for i, (o, e) in enumerate(zip(outputs[0], right))
             if not torch.allclose(o, e, rtol=1e-5, atol=1e-5))
    diff = (outputs[0][j] - right[j]).abs().max().item()
    fail(f"step {calls[0][j]['step']}, bucket {calls[0][j]['index']}: your averaged gradient "
         f"differs from top-k with error feedback by up to {diff:.3g}.",
         fix=("reconsider, per rank and call, what it could send (this call and what waited), "
              "what it sends, what it keeps, and how the ranks' entries become one average (the "
              "stretch's hint 2)."))


def _diagnose_asynchrony(results: list) -> None:
    """Right values, but did the backward go on while they travelled? Refuse a collective the
    hook launched without ``async_op=True``, and a future that was already complete on every
    call when the hook returned (rank 0 reaches its hook ahead of the others on the staggered
    steps, so only a hook that waited inside returns a completed future there)."""
    __tracebackhide__ = True
    blocking = sorted({f for r in results for f in r.get("blocking", [])})
    if blocking:
        fail(f"your hook's {' and '.join(blocking)} blocked (launched without async_op=True): "
             f"the backward stood still at every bucket until every rank had sent its part, "
             f"so nothing overlapped.",
             fix=("reconsider what the backward does while a blocking collective runs, and what "
                  "DDP waits on (lesson 07 §5)."))
    done = [c.get("done_at_return") for r in results for c in r["calls"]]
    if done and all(done):
        fail("the future your hook returned was already complete when the hook returned, on "
             "every call of every rank, even when the other ranks arrived later: the hook "
             "waited for its collectives inside (wait(), value()), so the backward stood still "
             "at every bucket.",
             fix="reconsider who waits on the hook's future, and when (lesson 07 §5).")
