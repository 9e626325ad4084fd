"""Checks for lab07: ``assign_buckets(params, bucket_cap_mb)`` and the learner's bucketed,
hook-driven data-parallel wrapper (a class with ``finish_gradient_synchronization()``).

``check_assign_buckets`` runs in this process on five sets of parameters (SmallCNN at two caps,
parameters larger than the cap, float64 parameters, a cap that holds the whole model). It
accepts both usual closing rules — close a bucket when the next parameter would take it over
the cap, or (DDP's) once it has reached the cap — and names: forward order, a bucket per
parameter, everything in one bucket, elements counted instead of bytes, 4 bytes assumed per
element, parameters lost or repeated.

``check_bucketed_ddp`` runs the class on 2 ranks (3 buckets) and then 3 ranks (another cap, 4
buckets) for 3 steps, and real ``DistributedDataParallel`` after it on the same shards. While
the learner's class runs, ``dist.all_reduce`` is replaced by a spy that records every call
(size, ``async_op``, when it was launched and when it was waited on) and hands the reduced
values over **only when the handle is waited on**: a wrapper that steps before waiting then
steps with un-reduced gradients every time, not just when a race happens to be lost. A hook
registered before the learner's own stores each local gradient as autograd produces it. From
that record the check names: one all-reduce per parameter instead of per bucket, messages that
are not a bucket's flat buffer, a blocking all-reduce in the hook, waiting inside the hook,
launching only after the backward, not waiting before the step, no reset between steps,
old handles waited on again (the list never emptied),
forgetting the division, dividing by a fixed 2, a slice copied back into the wrong parameter.

``check_topk_hook`` (the stretch) runs the learner's DDP communication hook — top-k with
error feedback — in real DDP on 2 and 3 ranks and compares every call with a replay of the
algorithm on the same buckets (see the section's comment below).
"""

from __future__ import annotations

import re
import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import launch
from . import fail, has_todo, passed

__all__ = ["check_assign_buckets", "check_bucketed_ddp", "check_topk_hook", "CONFIGS",
           "DEFAULT_TIMEOUT", "HOOK_WORLD_SIZES", "HOOK_FRACTION"]

DEFAULT_TIMEOUT = 30.0
MiB = 2 ** 20

# --------------------------------------------------------------------------------------------
# assign_buckets
# --------------------------------------------------------------------------------------------


def _small_cnn(width: int = 8) -> nn.Module:
    from ..models import SmallCNN

    torch.manual_seed(0)
    return SmallCNN(width=width)


def _params_of(numels, dtype=torch.float32) -> list:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]


def _bucket_cases() -> list[tuple[str, list, float]]:
    """(what, parameters in registration order, cap in MiB); no boundary within 10% of a cap,
    so MB (1e6) and MiB (2**20) give the same buckets."""
    cnn = list(_small_cnn().parameters())
    return [
        ("SmallCNN(width=8), cap 0.05 MiB", cnn, 0.05),
        ("SmallCNN(width=8), cap 0.01 MiB", cnn, 0.01),
        ("6 parameters, two larger than the cap", _params_of(
            [300_000, 10, 100_000, 100_000, 100_000, 400_000]), 1.0),
        ("4 float64 parameters of 0.38 MiB each", _params_of([50_000] * 4, torch.float64), 1.0),
        ("SmallCNN(width=8), cap 100 MiB", cnn, 100.0),
    ]


def _greedy(sizes: list[float], cap: float, order: list[int]) -> list[list[int]]:
    """Indices grouped by 'close when the next would exceed the cap'."""
    buckets, current, total = [], [], 0.0
    for i in order:
        if current and total + sizes[i] > cap:
            buckets.append(current)
            current, total = [], 0.0
        current.append(i)
        total += sizes[i]
    if current:
        buckets.append(current)
    return buckets


def _mb(nbytes: float) -> str:
    return f"{nbytes / MiB:.3g} MiB"


def bucket_problem(buckets, params: list, cap_mb: float, what: str = "") -> str | None:
    """None if ``buckets`` is a right assignment of ``params`` for ``cap_mb``, else the
    sentence naming the mistake. (Used by both checks.)"""
    where = f" ({what})" if what else ""
    if not isinstance(buckets, (list, tuple)) or not all(isinstance(b, (list, tuple))
                                                         for b in buckets):
        return (f"the buckets must be a list of lists of parameters, got "
                f"{type(buckets).__name__}{where}.")
    ids = {id(p): i for i, p in enumerate(params)}
    flat = [p for b in buckets for p in b]
    if any(id(p) not in ids for p in flat):
        return (f"a bucket holds something that is not one of the parameters given{where}: put "
                f"the parameter objects themselves in the buckets (not names, copies or grads).")
    got = [ids[id(p)] for p in flat]
    if len(got) != len(set(got)):
        return f"a parameter is in more than one bucket{where}: each goes in exactly one."
    if len(got) != len(params):
        return (f"{len(params) - len(got)} of the {len(params)} parameters are in no bucket"
                f"{where}: every parameter needs one, or its gradient is never averaged.")
    if any(len(b) == 0 for b in buckets):
        return f"there is an empty bucket{where}: it would launch an all-reduce of nothing."
    n = len(params)
    if got == list(range(n)) and n > 1:
        return (f"the buckets are filled in forward (registration) order{where}: the backward "
                f"produces the LAST layer's gradient first, so walk reversed(params) — then the "
                f"first bucket is complete early and goes on the wire while the backward runs.")
    if got != list(range(n - 1, -1, -1)):
        return (f"the parameters are not in reverse registration order across the buckets"
                f"{where}: walk reversed(params) and never reorder them.")
    sizes = [p.numel() * p.element_size() for p in params]
    cap = cap_mb * MiB
    idx = [[ids[id(p)] for p in b] for b in buckets]
    if all(len(b) == 1 for b in idx) and len(idx) > 1 and sizes[idx[0][0]] + sizes[idx[1][0]] <= cap:
        return (f"every parameter has a bucket of its own{where}: fill a bucket until the next "
                f"parameter would take it over {cap_mb} MiB — fewer, larger all-reduces.")
    for k, b in enumerate(idx):
        before_last = sum(sizes[i] for i in b[:-1])
        if before_last >= cap:
            return (f"bucket {k} holds {_mb(sum(sizes[i] for i in b))} in {len(b)} parameters, "
                    f"more than the cap of {cap_mb} MiB already before its last one{where}: "
                    f"start a new bucket when the next parameter would take it over the cap.")
        if k + 1 < len(idx) and sum(sizes[i] for i in b) + sizes[idx[k + 1][0]] <= cap:
            return (f"bucket {k} was closed at {_mb(sum(sizes[i] for i in b))} although the next "
                    f"parameter ({_mb(sizes[idx[k + 1][0]])}) still fitted under the cap of "
                    f"{cap_mb} MiB{where}: fill each bucket up to the cap.")
    return None


def check_assign_buckets(assign_buckets) -> None:
    """Run ``assign_buckets(params, bucket_cap_mb)`` on five sets of parameters and caps."""
    __tracebackhide__ = True
    if not callable(assign_buckets):
        fail(f"the check needs your function, got {type(assign_buckets).__name__}.")
    if has_todo(assign_buckets):
        raise NotImplementedError("assign_buckets still raises NotImplementedError: replace the "
                                  "TODO with your answer.")
    counts, problems, got = [], [], []
    cases = _bucket_cases()
    for what, params, cap in cases:
        try:
            buckets = assign_buckets(list(params), cap)
        except NotImplementedError:
            raise
        except Exception as exc:
            fail(f"assign_buckets raised {type(exc).__name__}: {exc} ({what}).")
        problem = bucket_problem(buckets, params, cap, what)
        if problem:
            problems.append(problem)
        else:
            counts.append(len(buckets))
        ids = {id(p): i for i, p in enumerate(params)}
        try:
            got.append([[ids.get(id(p)) for p in b] for b in buckets])
        except TypeError:
            got.append(None)
    if problems:
        # Sizes measured in the wrong unit give buckets that are right for that unit in
        # every case: name the unit rather than the first over-full bucket.
        for variant, size_of in (("counted elements (p.numel()) as bytes", lambda p: p.numel()),
                                 ("assumed 4 bytes per element", lambda p: 4 * p.numel())):
            predicted = [_greedy([size_of(p) for p in params], cap * MiB,
                                 list(range(len(params) - 1, -1, -1)))
                         for _, params, cap in cases]
            if got == predicted:
                fail(f"the buckets are what you get if you {variant}: a parameter's size in "
                     f"bytes is p.numel() * p.element_size().")
        fail(problems[0])
    passed(f"assign_buckets: reverse order, filled up to the cap, in bytes "
           f"({'/'.join(map(str, counts))} buckets in the five cases)")


# --------------------------------------------------------------------------------------------
# The wrapper, on 2 and 3 ranks
# --------------------------------------------------------------------------------------------

CONFIGS = ((2, 0.05), (3, 0.01))   # (world size, bucket_cap_mb): 3 buckets, then 4
_STEPS = 3
_GLOBAL_BATCH = 24


class _Deferred:
    """What the spy returns for ``all_reduce(..., async_op=True)``: the real all-reduce runs on
    a copy, and its result is written into the learner's tensor when the handle is waited on
    (or its future completes)."""

    def __init__(self, work, buf, target, rec, state):
        self._work, self._buf, self._target, self._rec = work, buf, target, rec
        self._state = state          # the check's current step, to notice stale handles
        self._delivered = False

    def _deliver(self):
        if not self._delivered:
            self._target.copy_(self._buf)
            self._delivered = True

    def wait(self, *args, **kwargs):
        if self._state["step"] != self._rec["step"]:
            self._state["stale_waits"].append((self._state["step"], self._rec["step"]))
        self._work.wait(*args, **kwargs)
        if self._rec["t_wait"] is None:
            self._rec["t_wait"] = time.perf_counter()
        self._deliver()
        return True

    def is_completed(self):
        return self._work.is_completed() and self._delivered

    def get_future(self):
        self._rec["future"] = True

        def delivered(fut):
            self._deliver()
            if self._rec["t_wait"] is None:
                self._rec["t_wait"] = time.perf_counter()
            return [self._target]

        return self._work.get_future().then(delivered)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _bucketed_worker(rank: int, world_size: int, cls, cap_mb: float) -> dict:
    __tracebackhide__ = True
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .. import ddp

    dev = ddp.rank_device()
    cfg = ddp.StepConfig(global_batch=_GLOBAL_BATCH, steps=_STEPS, lr=0.1, width=8, n_train=96)
    batches = [ddp.shard_of(*ddp.global_batch_for_step(cfg, s), rank, world_size)
               for s in range(_STEPS)]
    module = _small_cnn().to(dev)
    params = list(module.parameters())
    names = [n for n, _ in module.named_parameters()]
    index = {id(p): i for i, p in enumerate(params)}
    local, ready = {}, {}

    def spy_ready(p):  # registered before the learner's hooks, so it runs first
        local[index[id(p)]] = p.grad.detach().clone()
        ready[index[id(p)]] = time.perf_counter()

    for p in params:
        p.register_post_accumulate_grad_hook(spy_ready)

    real = dist.all_reduce
    calls: list[dict] = []
    state = {"step": -1, "stale_waits": []}

    def spy_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        rec = {"step": state["step"], "numel": tensor.numel(), "async": bool(async_op),
               "t_launch": time.perf_counter(), "t_wait": None, "future": False}
        calls.append(rec)
        if not async_op:
            real(tensor, op=op, group=group)
            rec["t_wait"] = time.perf_counter()
            return None
        buf = tensor.detach().clone()
        return _Deferred(real(buf, op=op, group=group, async_op=True), buf, tensor, rec, state)

    steps = []
    dist.all_reduce = spy_all_reduce
    try:
        model = cls(module, bucket_cap_mb=cap_mb)
        buckets = getattr(model, "buckets", None)
        try:
            bucket_idx = [[index.get(id(p), -1) for p in b] for b in buckets]
        except TypeError:
            bucket_idx = None
        if not hasattr(model, "finish_gradient_synchronization"):
            raise AttributeError("the class has no finish_gradient_synchronization() method")
        opt = torch.optim.SGD(module.parameters(), lr=cfg.lr)
        for step, (X, y) in enumerate(batches):
            state["step"] = step
            local.clear()
            ready.clear()
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            F.cross_entropy(model(X.to(dev)), y.to(dev)).backward()
            t_backward = time.perf_counter()
            model.finish_gradient_synchronization()
            t_finish = time.perf_counter()
            after = [None if p.grad is None else p.grad.detach().cpu().clone() for p in params]
            own = [local.get(i) for i in range(len(params))]
            if any(g is None for g in own):
                raise RuntimeError("the check's own hook saw no gradient for some parameter")
            mean = []
            for g in own:              # the right answer, with the real collective
                m = g.clone()
                real(m)
                mean.append((m / world_size).cpu())
            ms = lambda t: None if t is None else (t - t0) * 1e3
            steps.append({
                "after": after, "own": [g.cpu() for g in own],
                "mean": mean, "ready": {i: ms(t) for i, t in ready.items()},
                "backward_end": ms(t_backward), "finish_end": ms(t_finish),
                "calls": [dict(c, t_launch=ms(c["t_launch"]), t_wait=ms(c["t_wait"]))
                          for c in calls if c["step"] == step],
                "stale_waits": [old for now, old in state["stale_waits"] if now == step],
            })
            opt.step()
        learner = ddp.flat_params(module)
    finally:
        dist.all_reduce = real
    # Real DDP from the same start on the same shards: the answer the wrapper must equal.
    ref = _small_cnn().to(dev)
    ddp_model = DDP(ref, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=cfg.lr)
    for X, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp_model(X.to(dev)), y.to(dev)).backward()
        opt.step()
    return {"steps": steps, "params": learner, "ddp": ddp.flat_params(ref),
            "buckets": bucket_idx, "names": names,
            "numels": [p.numel() for p in params]}


def _launch(cls, world_size: int, cap_mb: float, timeout: float) -> list:
    __tracebackhide__ = True
    from .. import devices, launch

    backend = devices.backend_for(world_size)
    try:
        return launch.spawn(_bucketed_worker, world_size, cls, cap_mb, backend=backend,
                            timeout=timeout, show_output=False)
    except launch.LaunchTimeoutError as exc:
        who = ", ".join(map(str, exc.pending)) or "some rank"
        fail(f"rank(s) {who} never finished within {timeout:g} s — a deadlock: every rank must "
             f"launch the same all-reduces in the same order (same buckets, no rank-dependent "
             f"branches), and every launched all-reduce must be waited on.")
    except launch.RankFailedError as exc:
        if exc.summary.startswith("NotImplementedError"):
            raise NotImplementedError(f"{exc.summary} (on rank {exc.rank})") from None
        if "AVG" in exc.summary or "ReduceOp" in exc.summary:
            fail(f"your code raised on rank {exc.rank}: {exc.summary} — this backend refuses "
                 f"that reduce op: all-reduce with SUM and divide by the world size.")
        fail(f"your code raised on rank {exc.rank}: {exc.summary}")


def _close(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and \
        torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def check_bucketed_ddp(cls, configs=CONFIGS, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Run the learner's wrapper class for 3 steps on 2 ranks (cap 0.05 MiB) and on 3 ranks
    (cap 0.01 MiB); its collectives, its timeline and its gradients are checked at every step,
    and its final weights against real DDP's."""
    __tracebackhide__ = True
    if not isinstance(cls, type):
        fail(f"the check needs your class itself (BucketedDDP, not BucketedDDP(...)), got "
             f"{type(cls).__name__}.")
    if has_todo(cls):
        raise NotImplementedError(f"{cls.__name__} still raises NotImplementedError in a method: "
                                  f"replace the TODOs with your answer.")
    for world_size, cap_mb in configs:
        results = _launch(cls, world_size, cap_mb, timeout)
        _diagnose(results, world_size, cap_mb)
    shown = " and ".join(f"{ws} ranks ({cap} MiB buckets)" for ws, cap in configs)
    passed(f"{cls.__name__}: one async all-reduce per bucket, launched during the backward, "
           f"waited before the step; weights == DDP's after {_STEPS} steps on {shown}")


def _diagnose(results: list, world_size: int, cap_mb: float) -> None:
    __tracebackhide__ = True
    r0 = results[0]
    names, numels = r0["names"], r0["numels"]
    buckets = r0["buckets"]
    if buckets is None:
        fail("the wrapper has no self.buckets list of lists of parameters: keep the buckets "
             "from assign_buckets in self.buckets.")
    if any(i < 0 for b in buckets for i in b):
        fail("self.buckets holds something that is not one of the model's parameters.")
    params = list(_small_cnn().parameters())
    problem = bucket_problem([[params[i] for i in b] for b in buckets], params, cap_mb)
    if problem:
        fail(f"self.buckets is wrong at {cap_mb} MiB: {problem}")
    bucket_numels = sorted(sum(numels[i] for i in b) for b in buckets)
    for rank, r in enumerate(results):
        for step, s in enumerate(r["steps"]):
            _diagnose_step(s, step, rank, world_size, buckets, bucket_numels, names, numels)
    for rank, r in enumerate(results):
        if not torch.allclose(r["params"], r["ddp"], rtol=1e-4, atol=1e-6):
            fail(f"every step's gradients were right, but after {_STEPS} steps rank {rank}'s "
                 f"weights differ from DDP's: leave the optimizer step to the caller and do "
                 f"not change the weights in the wrapper.")


def _diagnose_step(s, step, rank, world_size, buckets, bucket_numels, names, numels) -> None:
    __tracebackhide__ = True
    calls = s["calls"]
    n_params = len(names)
    when = f"in step {step + 1}" + (f" on rank {rank}" if rank else "")
    # 1. How many all-reduces, and how large.
    if not calls:
        if step > 0:
            fail(f"no all-reduce was launched {when}, after a first step that had them: at the "
                 f"end of finish_gradient_synchronization() reset each bucket's count of awaited "
                 f"gradients (and the list of handles) for the next backward.")
        fail("the check saw no dist.all_reduce call: launch it as dist.all_reduce(buffer, "
             "async_op=True) from the hook (the check counts calls made through "
             "torch.distributed).")
    sync_in_backward = [c for c in calls if not c["async"] and c["t_launch"] < s["backward_end"]]
    if sync_in_backward:
        fail("the hook calls a blocking all_reduce (no async_op=True): the backward stops until "
             "each bucket has crossed the wire, so nothing overlaps — launch it with "
             "async_op=True, keep the handle, and wait in finish_gradient_synchronization().")
    if len(calls) != len(buckets):
        if len(calls) == n_params:
            fail(f"{len(calls)} all-reduces {when}, one per parameter: copy the gradients into "
                 f"their bucket's flat buffer and all-reduce each bucket once "
                 f"({len(buckets)} calls).")
        fail(f"{len(calls)} all-reduces {when} for {len(buckets)} buckets: launch exactly one "
             f"per bucket, when its last gradient has arrived.")
    if sorted(c["numel"] for c in calls) != bucket_numels:
        fail(f"the all-reduces {when} carried {sorted(c['numel'] for c in calls)} elements; "
             f"the buckets hold {bucket_numels}: all-reduce each bucket's whole flat buffer "
             f"(the sum of its parameters' numel).")
    # 2. When they were launched and waited on.
    if all(c["t_launch"] >= s["backward_end"] for c in calls):
        fail("every all-reduce was launched after the backward had finished (in "
             "finish_gradient_synchronization): nothing overlaps the backward — launch each "
             "bucket from the hook, as soon as its last gradient has arrived.")
    waited_early = [c for c in calls if c["async"] and c["t_wait"] is not None
                    and not c["future"] and c["t_wait"] < s["backward_end"]]
    if waited_early:
        fail("you waited on each all-reduce inside the hook (work.wait() before the backward "
             "had finished): the backward stalls until each bucket has crossed the wire, so "
             "nothing overlaps — keep the handles and wait in finish_gradient_synchronization().")
    unwaited = [c for c in calls if c["async"] and c["t_wait"] is None and not c["future"]]
    if unwaited:
        fail(f"finish_gradient_synchronization() returned while {len(unwaited)} of "
             f"{len(calls)} all-reduces had not been waited on: optimizer.step() would read "
             f"gradients the all-reduce may still be writing (a race) — call wait() on every "
             f"handle, then copy back.")
    if s["stale_waits"]:
        fail(f"{when}, finish_gradient_synchronization() waited again on "
             f"{len(s['stale_waits'])} handle(s) from step {s['stale_waits'][0] + 1}: empty the "
             f"list of handles after waiting, or it grows by one per bucket every step (and "
             f"old buffers are copied back again each time).")
    # 3. The gradients left for optimizer.step().
    after, own, mean = s["after"], s["own"], s["mean"]
    if any(a is None for a in after):
        missing = [names[i] for i, a in enumerate(after) if a is None]
        fail(f"p.grad is None for {missing[:3]} after finish_gradient_synchronization() {when}: "
             f"copy the averages back into every p.grad.")
    for i, (a, m) in enumerate(zip(after, mean)):
        if a.shape != m.shape:
            fail(f"{names[i]}.grad has shape {tuple(a.shape)} instead of {tuple(m.shape)}: copy "
                 f"its slice back with .view_as(p.grad).")
    if all(_close(a, m) for a, m in zip(after, mean)):
        return
    total = [m * world_size for m in mean]
    if all(_close(a, t) for a, t in zip(after, total)):
        fail(f"the gradients hold the sum over the ranks, {world_size} times the mean, {when}: "
             f"divide each bucket by the world size (before the all-reduce or after the wait).")
    for k in sorted({2, 3, 4} - {world_size}):
        if all(_close(a, t / k) for a, t in zip(after, total)):
            fail(f"on {world_size} ranks the gradients are the sum divided by {k}: divide by "
                 f"dist.get_world_size(), not by a fixed {k}.")
    if all(_close(a, o) for a, o in zip(after, own)):
        fail(f"p.grad still holds this rank's own gradient after finish_gradient_"
             f"synchronization() {when}: copy each bucket's averaged slices back into p.grad "
             f"after waiting.")
    wrong = [i for i, (a, m) in enumerate(zip(after, mean)) if not _close(a, m)]
    for i in wrong:
        others = [j for j in range(n_params) if j != i and numels[j] == numels[i]
                  and _close(after[i].reshape(-1), mean[j].reshape(-1))]
        if others:
            fail(f"{names[i]}.grad holds the averaged gradient of {names[others[0]]}: a slice "
                 f"was copied back into the wrong parameter — use the offset recorded for each "
                 f"parameter when its gradient was copied in.")
    fail(f"{names[wrong[0]]}.grad is not the mean over the ranks {when} (nor the sum, nor this "
         f"rank's own gradient): it holds values from elsewhere in the bucket's buffer — copy in "
         f"and copy back each parameter at the same offset, and all-reduce the whole buffer.")


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
_SENT_PER_ENTRY = 16              # budget per selected entry: a value and its int64 index, padded


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


def _payload_bytes(name, bound) -> int:
    """What this rank hands to a collective: the tensor(s) it contributes."""
    import pickle

    args = bound.arguments
    if name == "all_gather_object":
        return len(pickle.dumps(args["obj"]))
    for key in ("input_tensor", "input", "tensor"):
        t = args.get(key)
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
    t = args.get("input_tensor_list") or args.get("tensor_list") or []
    return sum(x.numel() * x.element_size() for x in t if isinstance(x, torch.Tensor))


_SPIED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
          "broadcast", "reduce", "gather", "reduce_scatter", "reduce_scatter_tensor",
          "all_to_all", "all_to_all_single", "send", "isend")


class _HookRaised(RuntimeError):
    """The learner's hook raised; the message carries what it raised."""


def _topk_worker(rank: int, world_size: int, hook, state_cls, fraction: float,
                 cap_mb: float = _HOOK_CAP_MB, sizes=_HOOK_SIZES) -> dict:
    __tracebackhide__ = True
    import inspect
    import traceback

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_Probe(sizes), bucket_cap_mb=cap_mb)
    state = state_cls(fraction)
    calls, sent, problems, step_now = [], [0] * _HOOK_STEPS, [], [0]
    real = {name: getattr(dist, name) for name in _SPIED if hasattr(dist, name)}

    def spy(name):
        fn, sig = real[name], inspect.signature(real[name])

        def spied(*args, **kwargs):
            try:
                sent[step_now[0]] += _payload_bytes(name, sig.bind(*args, **kwargs))
            except TypeError:
                pass          # a call torch itself will reject; let it say so
            return fn(*args, **kwargs)
        return spied

    def spy_hook(hook_state, bucket):
        buf = bucket.buffer()
        rec = {"step": step_now[0], "index": bucket.index(), "input": buf.detach().clone(),
               "output": None}
        calls.append(rec)
        try:
            fut = hook(hook_state, bucket)
        except Exception as exc:
            problems.append(("raised", "".join(
                traceback.format_exception_only(type(exc), exc)).strip()))
            raise
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
    try:
        for name in real:
            setattr(dist, name, spy(name))
        for step in range(_HOOK_STEPS):
            step_now[0] = step
            model.zero_grad(set_to_none=True)
            try:
                model(_probe_gradients(rank, step, sizes)).backward()
            except Exception as exc:
                if problems and problems[-1][0] == "raised":
                    raise _HookRaised(problems[-1][1]) from None
                raise
            if problems:
                break
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"calls": calls, "sent": sent, "problems": problems}


def _topk_replay(inputs: list, world_size: int, k_of, *, feedback=True, magnitude=True,
                 clear=True, select_corrected=True, add=True, scale=None, k_shift=0) -> list:
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
            left = corrected.clone()
            if clear:
                left[idx] = 0
            residuals[r][index] = left
        outputs.append(out * (1.0 / world_size if scale is None else scale))
    return outputs


# What a gloo rank reports when its peer has gone away (aborted or died) mid-collective.
_PEER_LOST = re.compile(launch.PEER_LOST.pattern + r"|Connection (reset|closed)|pair\.cc")


def _launch_hook(hook, state_cls, world_size: int, fraction: float, timeout: float) -> list:
    __tracebackhide__ = True
    from .. import launch

    try:
        return launch.spawn(_topk_worker, world_size, hook, state_cls, fraction,
                            backend="gloo", timeout=timeout, show_output=False)
    except launch.LaunchTimeoutError as exc:
        who = ", ".join(map(str, exc.pending)) or "some rank"
        fail(f"rank(s) {who} never finished within {timeout:g} s — a deadlock: every rank must "
             f"make the same collectives in the same order, whatever it selected (all_gather "
             f"tensors of the same size on every rank: k values and k indices).")
    except launch.RankFailedError as exc:
        summary = exc.summary.removeprefix(f"{_HookRaised.__name__}: ")
        hint = ""
        if "size" in summary or "shape" in summary or "match" in summary:
            hint = (" — if it is the residual: DDP rebuilds its buckets after the first step, "
                    "so keep residuals through state.residual_for(bucket), which restarts one "
                    "whose size changed")
        elif "died" in summary or _PEER_LOST.search(summary):
            # gloo aborts the rank that sees a size mismatch; its peer then reports a reset
            # connection, and whichever report arrives first is the one we see.
            hint = (" — gloo aborts a rank when the ranks' tensors in one collective differ in "
                    "size (its peer then sees the connection drop): every rank must gather "
                    "exactly state.k(numel) values and indices")
        what = "died in your hook" if "died" in summary else "raised in your hook"
        fail(f"rank {exc.rank} {what}: {summary}{hint}.")


_PROBLEMS = {
    "not_future": "your hook returned a {} — DDP needs a torch.futures.Future of the averaged "
                  "buffer: fut = torch.futures.Future(); fut.set_result(out); return fut "
                  "(or work.get_future().then(...)).",
    "list": "your hook's future delivered a {} — DDP wants the tensor itself (an all_reduce "
            "future holds [tensor]: add .then(lambda f: f.value()[0]).",
    "not_tensor": "your hook's future delivered a {}, not a tensor the size of "
                  "bucket.buffer().",
    "shape": "your hook's future delivered a tensor of shape {0[0]} and {0[1]}, but the "
             "bucket is {0[2]} of {0[3]}: return a dense tensor like bucket.buffer() (put the "
             "gathered values back at their indices in torch.zeros_like(buffer)).",
}


def check_topk_hook(hook, state_cls, world_sizes=HOOK_WORLD_SIZES, fraction=HOOK_FRACTION,
                    timeout: float = DEFAULT_TIMEOUT) -> None:
    """Run the learner's comm hook in real DDP (probe model, 12 steps, two buckets after DDP's
    rebuild) on 2 and 3 ranks; compare every hook call with top-k + error feedback replayed on
    the same buckets, weigh what each rank sends, and name the mistake when they differ."""
    __tracebackhide__ = True
    if not callable(hook) or isinstance(hook, type):
        fail(f"the check needs your hook function itself (topk_hook), got "
             f"{type(hook).__name__}.")
    if has_todo(hook):
        raise NotImplementedError("topk_hook still raises NotImplementedError: replace the "
                                  "TODO with your answer.")
    for world_size in world_sizes:
        results = _launch_hook(hook, state_cls, world_size, fraction, timeout)
        _diagnose_hook(results, world_size, state_cls(fraction).k)
    shown = " and ".join(map(str, world_sizes))
    passed(f"{getattr(hook, '__name__', 'hook')}: top-k with error feedback equals the replay "
           f"on {shown} ranks for {_HOOK_STEPS} steps, sending ≤ {_SENT_PER_ENTRY} bytes per "
           f"selected entry ({fraction:.0%} of the entries)")


def _diagnose_hook(results: list, world_size: int, k_of) -> None:
    __tracebackhide__ = True
    for r in results:
        for kind, detail in r["problems"]:
            fail(_PROBLEMS[kind].format(detail))
    calls = [r["calls"] for r in results]
    outputs = [[c["output"] for c in rc] for rc in calls]
    inputs = [[(c["index"], c["input"]) for c in rc] for rc in calls]
    for j, out0 in enumerate(outputs[0]):
        step, index = calls[0][j]["step"], calls[0][j]["index"]
        for rank in range(1, world_size):
            if not torch.allclose(outputs[rank][j], out0, rtol=1e-5, atol=1e-6):
                own = all(torch.equal(outputs[r][j], inputs[r][j][1]) for r in range(world_size))
                why = ("each returned its own gradient unchanged" if own else
                       "the hook must gather every rank's selected values and return the same "
                       "average on each")
                fail(f"step {step}, bucket {index}: rank 0 and rank {rank} got different "
                     f"gradients — {why}, or the replicas drift apart.")
    for step in range(_HOOK_STEPS):
        numels = [c["input"].numel() for c in calls[0] if c["step"] == step]
        dense = sum(n * 4 for n in numels)
        budget = sum(_SENT_PER_ENTRY * k_of(n) + 64 for n in numels)
        sent = max(r["sent"][step] for r in results)
        if sent >= dense:
            fail(f"step {step}: a rank sent {sent} bytes for {dense} bytes of gradient — the "
                 f"whole tensor (even one that is mostly zeros) saves nothing: send only the "
                 f"k selected values and their indices (all_gather).")
        if sent > budget:
            fail(f"step {step}: a rank sent {sent} bytes, more than k values and k indices "
                 f"({budget} bytes at {_SENT_PER_ENTRY} per entry): send only the top-k.")
    right = _topk_replay(inputs, world_size, k_of)
    if all(torch.allclose(o, e, rtol=1e-5, atol=1e-5) for o, e in zip(outputs[0], right)):
        return
    wrong = [
        (dict(feedback=False),
         "your results are top-k **without** error feedback: keep what was not sent in the "
         "bucket's residual and add it to the next step's gradient before choosing — otherwise "
         "small gradients are never sent at all."),
        (dict(magnitude=False),
         "you chose the k largest values, not the k largest magnitudes: large negative "
         "gradients are never sent — rank the entries by .abs()."),
        (dict(clear=False),
         "the residual still holds the values that were sent: zero the sent entries (residual "
         "= corrected - sent), or every step sends them again."),
        (dict(select_corrected=False),
         "you chose the top k of this step's gradient alone: choose them from gradient + "
         "residual, so that what waited long enough gets its turn."),
        (dict(add=False),
         "where two ranks selected the same index one value overwrote the other: add the "
         "gathered values (index_add_ / scatter_add_), do not assign them."),
        (dict(scale=1.0),
         "you summed the ranks' values without averaging: divide by the world size."),
        (dict(scale=1.0 / world_size ** 2),
         "you divided by the world size twice."),
        (dict(scale=0.5),
         "you divided by 2, not by the world size: use dist.get_world_size()."),
        (dict(k_shift=1), "you sent k + 1 entries: send exactly state.k(numel)."),
        (dict(k_shift=-1), "you sent k - 1 entries: send exactly state.k(numel)."),
    ]
    for kwargs, message in wrong:
        if kwargs.get("scale") == 0.5 and world_size == 2:
            continue
        guess = _topk_replay(inputs, world_size, k_of, **kwargs)
        if all(torch.allclose(o, e, rtol=1e-5, atol=1e-5) for o, e in zip(outputs[0], guess)):
            fail(message)
    j = next(i for i, (o, e) in enumerate(zip(outputs[0], right))
             if not torch.allclose(o, e, rtol=1e-5, atol=1e-5))
    diff = (outputs[0][j] - right[j]).abs().max().item()
    fail(f"step {calls[0][j]['step']}, bucket {calls[0][j]['index']}: your averaged gradient "
         f"differs from top-k with error feedback by up to {diff:.3g} — per rank: corrected = "
         f"gradient + residual; send the k largest |corrected|; residual = corrected with the "
         f"sent entries zeroed; return the sum of everyone's sent values / world size.")
