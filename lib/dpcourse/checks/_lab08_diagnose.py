"""How lab08's ZeroTwo check tells one wrong ZeroTwo from another: the cases it runs (the model,
its frozen and tied parameters, the configurations, the memory limit), and the diagnosis that
turns what the learner's code did on the ranks that finished — its weights after each step,
its schedule of reduce-scatters, the gradient memory alive at each arrival — into the one
sentence that names its mistake.

:mod:`dpcourse.checks.lab08` holds the public checks and the workers that run the learner's
code; it calls these after each launch. Kept apart so that each file holds one idea: running
the learner's code, and reading what it did. An exception a rank raised is read in
:mod:`dpcourse.checks._lab08_raised` (which borrows two sentences from here, ``_DTYPE_WHY`` and
``_early``); part 1's ``shard_bounds`` (check and diagnosis) is
:mod:`dpcourse.checks._lab08_bounds`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import fail
from ._lab08_bounds import ALIGN_BYTES

CONFIGS = ((2, "adam"), (3, "sgd"))


DEFAULT_TIMEOUT = 30.0


BUCKET_CAP = 128                      # bytes: 32 fp32 numbers, about one small layer


_STEPS = 3


_GLOBAL_BATCH = 12


_WIDTHS = (6, 8, 8, 8, 8, 8, 8, 3)   # seven Linear layers, Tanh between them


_FROZEN = "4.bias"                    # requires_grad=False: it never gets a gradient


_TIED = ("8.weight", "4.weight")      # layer 8 computes with layer 4's weight


_LATE = "1.weight"                    # registered after layer 0, applied before it


class _GainTanh(nn.Tanh):
    """Layer 0's activation, which also holds the model's input gain (a learnable scalar):
    the gain is registered after layer 0's weight and bias but applied before layer 0, so its
    gradient completes after theirs — gradients need not arrive in the reverse of the order
    the parameters are listed."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))


class _GainMLP(nn.Sequential):
    """The seven layers, their input multiplied first by the gain that module 1 holds."""

    def forward(self, x):
        return super().forward(x * self[1].weight)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(_WIDTHS[:-1], _WIDTHS[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
    layers[1] = _GainTanh()
    model = _GainMLP(*layers[:-1])
    model[4].bias.requires_grad_(False)
    model[8].weight = model[4].weight
    return model


def _trainable_numels() -> list[int]:
    return [p.numel() for p in _mlp().parameters() if p.requires_grad]


def _live_limit(world_size: int) -> int:
    """Gradient numbers a rank may hold at once besides its gradient shard: the bucket being
    filled and the one in flight, each at most a cap plus the largest parameter (a bucket
    closes once it reaches the cap), plus padding."""
    biggest = max(_trainable_numels())
    return 2 * (BUCKET_CAP // 4 + biggest + world_size * ALIGN_BYTES // 4)


_DTYPE_WHY = ("a tensor made with torch.zeros/torch.empty/torch.tensor without dtype= takes "
              "torch's default dtype, which this check sets to float64, not the parameters' "
              "(and without device=, on a GPU it would sit on the CPU, where NCCL cannot send "
              "it): contract 6, every tensor you make follows the parameters' device and "
              "dtype.")


def _early(k: int, last: str, missing: str, members: list, prefix: str = "") -> None:
    """Bucket ``k`` was launched at the arrival of the parameter listed last in it, while
    ``missing``'s gradient had not arrived: the learner took "the last-listed parameter has
    arrived" for "the bucket is full"."""
    __tracebackhide__ = True
    fail(f"{prefix}bucket {k} ({', '.join(members)}) was launched when its last-listed "
         f"parameter, {last}, arrived, while {missing}'s gradient had not — its p.grad was "
         f"still None. Gradients do not always arrive in the reverse of the order the "
         f"parameters are listed: in the check's model {missing}"
         f"{', an input gain,' if missing == _LATE else ''} is listed after {last} but "
         f"applied before it in the forward, so its gradient completes after {last}'s. What you "
         f"may rely on is that each trainable parameter's hook runs once per backward, when "
         f"its gradient is complete — not in which order.",
         fix="take a bucket as full when every one of its parameters' hooks has run in this "
             "backward, whatever their order (count the arrivals per bucket).")


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _edges(world_size: int) -> set[int]:
    """Indices next to a shard boundary of any parameter or of any run of parameters."""
    numels = [p.numel() for p in _mlp().parameters()]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    edges = set()
    for i in range(len(numels)):
        for j in range(i + 1, len(numels) + 1):          # every contiguous run: any bucket
            offset, n = starts[i], sum(numels[i:j])
            size = math.ceil(n / world_size)
            edges |= {offset + r * size + d for r in range(1, world_size) for d in (-1, 0)}
            edges |= {offset, offset + n - 1}
    return {e for e in edges if 0 <= e < sum(numels)}


def _diagnose(results: list, world_size: int, opt_name: str) -> str:
    __tracebackhide__ = True
    if results[0].get("dtype"):
        what, dtype = results[0]["dtype"]
        fail(f"{what} is {dtype.replace('torch.', '')} while the parameters are float32 — "
             f"{_DTYPE_WHY}")
    if results[0].get("views"):
        what, (numbers, kept) = next(iter(results[0]["views"].items()))
        fail(f"{what} is a view of a larger tensor: it uses {numbers} bytes but keeps {kept} "
             f"alive (the whole padded vector).",
             fix="make it a copy of this rank's slice (.clone(), or torch.cat, which copies).")
    trainable = _trainable_numels()
    total = sum(trainable)
    per_number = 2 if opt_name == "adam" else 1       # exp_avg + exp_avg_sq, or momentum
    most = sum(math.ceil(n / world_size) for n in trainable) + \
        (world_size + ALIGN_BYTES // 4) * len(trainable)
    for rank, r in enumerate(results):
        st = r["state_after"]
        if st["missing"]:
            fail("the wrapper has no self.optimizer (a torch optimizer), so the check cannot see "
                 "what state it keeps.", fix="keep the inner optimizer there, built over [self.shard].")
        if st["numel"] >= total:
            fail(f"rank {rank}'s inner optimizer steps {st['numel']} numbers, the whole model's "
                 f"{total} or more, so every rank keeps the whole optimizer state — no memory "
                 f"saved.", fix="give it only this rank's shard, [self.shard].")
        if st["bytes"] > most * per_number * 4:
            fail(f"rank {rank}'s optimizer state is {st['bytes']} bytes, more than one shard's "
                 f"({most} numbers × {per_number} × 4 bytes).")
    launched_any = any(e[0] == "launch" for r in results for s in r["steps"] for e in s["log"])
    if not launched_any and (all(r.get("hooked") == 0 for r in results) or
                             any(r.get("reread") for r in results)):
        what = ("registered no gradient hook" if all(r.get("hooked") == 0 for r in results)
                else "looped over params again once it was used up")
        fail(f"your wrapper {what} and reduce-scattered nothing: params is a generator "
             f"(model.parameters()), which runs out after one pass — a second loop over it "
             f"finds no parameter.", fix="make it a list first (list(params)).")
    _diagnose_frozen(results)
    _diagnose_schedule(results, world_size)
    for step in range(_STEPS):
        learner = [r["steps"][step]["learner"] for r in results]
        if not all(_close(w, learner[0]) for w in learner[1:]):
            _diagnose_drift(results, step)
        _diagnose_weights(results, step, world_size, opt_name)
    return _diagnose_memory(results, world_size, opt_name)


def _diagnose_frozen(results: list) -> None:
    __tracebackhide__ = True
    r0 = results[0]
    names = r0["names"]
    frozen = {n for n, _ in r0["frozen"]}
    last = r0["steps"][-1]["learner"]
    moved = [i for i, n in enumerate(names) if n in frozen and last[i] != r0["initial"][i]]
    if moved:
        fail(f"the frozen parameter {names[moved[0]]} (requires_grad=False) changed: it has no "
             f"gradient and must not be stepped.",
             fix="leave frozen parameters out of the buckets and the shard.")
    total = sum(_trainable_numels())
    for s in r0["steps"]:
        launched = sum(e[2] for e in s["log"] if e[0] == "launch")
        backward_launches = [e for e in s["log"] if e[0] == "launch" and e[4] == "backward"]
        if backward_launches and launched < total:
            fail(f"only {launched} of the {total} trainable gradient numbers were "
                 f"reduce-scattered: a bucket waited for a gradient that never came — the "
                 f"frozen parameter {r0['frozen'][0][0]} (requires_grad=False) gets none.",
                 fix="leave it out of the buckets.")


def _diagnose_weights(results: list, step: int, world_size: int, opt_name: str) -> None:
    __tracebackhide__ = True
    r0 = results[0]
    s = r0["steps"][step]
    w, ref = s["learner"], s["ddp"]
    if _close(w, ref):
        return
    after = f"after step {step + 1}"
    if _close(w, s["summed"]):
        fail(f"{after} the weights equal those of DDP with gradients {world_size}× too large: "
             f"you summed the gradients over the ranks (a reduce-scatter sums) and "
             f"self.shard.grad still held that sum when the inner optimizer stepped (a division "
             f"into a new tensor, out = out / n, leaves the shard's gradient as it was).",
             fix="divide self.shard.grad itself by the world size, in place.")
    if _close(w, s["twice"]):
        fail(f"{after} the weights equal those of DDP with gradients {world_size}× too small: "
             f"you divided by the world size twice.", fix="divide once, before or after the "
             f"reduction.")
    if step > 0 and _close(w, s["accumulated"]):
        fail(f"{after} the weights are what you get when the gradients of the earlier steps are "
             f"added to this one's: the shard's gradient held more than this step's gradient.",
             fix="overwrite it, or zero it in zero_grad().")
    if _close(w, r0["initial"]) and step == 0:
        if s.get("zero_grad_at_step"):
            fail("after step 1 the weights have not changed because self.shard.grad was all "
                 "zeros when the inner optimizer stepped: the reduce-scatters wrote somewhere "
                 "else (a slice of a 1-d tensor is a view into it; a new tensor is not).",
                 fix="give each one its bucket's slice of self.shard.grad itself as the output.")
        if s.get("shard_moved"):
            fail("after step 1 self.shard had moved but the model's parameters had not: the "
                 "all-gathered values never reached them (a new tensor or a rebound name is not the "
                 "parameters' memory).", fix="copy them into the parameters' own memory (p.data).")
        fail("after step 1 the weights have not changed: neither the shard nor the "
             "parameters moved.", fix="step the inner optimizer, then copy the gathered shards back "
             "into p.data.")
    bad = (~torch.isclose(w, ref, rtol=1e-5, atol=1e-6)).nonzero().flatten().tolist()
    if bad and set(bad) <= _edges(world_size):
        fail(f"{after} only the numbers at the shard edges {bad} are wrong: a shard boundary "
             f"is off by one.", fix="slice [start:end), end exclusive.")
    if not any(e[0] == "launch" for e in s["log"]):
        _diagnose_carried_counter(r0, step)
        fail(f"{after} every rank holds the same weights, but they differ from DDP's: no "
             f"reduce-scatter ran, so the gradients were never averaged over the ranks.",
             fix="reduce-scatter each bucket, then divide, before stepping the shard.")
    name = r0["names"][bad[0]]
    fail(f"{after} the weights differ from DDP + {opt_name} at {len(bad)} of {w.numel()} "
         f"numbers (first: index {bad[0]}, in {name}): some bucket's slice of the shard was not "
         f"stepped with this rank's slice of that bucket's averaged gradient, or not copied back "
         f"into that bucket's parameters in order.",
         fix="step each bucket's slice with its averaged gradient slice, then all-gather and "
             "copy back into the bucket's parameters in order.")


def _diagnose_carried_counter(r0: dict, step: int) -> None:
    """No reduce-scatter in this step, though an earlier step had them and every gradient
    arrived: is a per-bucket count of arrivals still where the earlier step left it?"""
    __tracebackhide__ = True
    s = r0["steps"][step]
    earlier = [t for t in r0["steps"][:step] if any(e[0] == "launch" for e in t["log"])]
    if step == 0 or not earlier:
        return
    arrivals = sum(1 for e in s["log"] if e[0] == "grad")
    start = r0.get("counters0", {})
    before = r0["steps"][step - 1].get("counters", {})
    carried = [(name, values) for name, values in before.items()
               if name in start and not any(start[name]) and any(values)]
    if not carried:
        return
    name, values = carried[0]
    fail(f"after step {step + 1} the weights differ from DDP's: step 1 launched "
         f"{sum(1 for e in earlier[0]['log'] if e[0] == 'launch')} reduce-scatters, step "
         f"{step + 1} none, though all {arrivals} gradients arrived — self.{name} started at "
         f"{start[name]} and still held {values} when step {step + 1}'s backward began: your "
         f"hooks' count of arrived gradients carried over from step 1, so no bucket ever "
         f"filled again (the gradients were never averaged).",
         fix=f"set a bucket's count in self.{name} back to 0 once it is full (or in "
             f"zero_grad()).")


def _diagnose_drift(results: list, step: int) -> None:
    __tracebackhide__ = True
    if step == 0:
        initial = results[0]["initial"]
        changed = [r["steps"][0]["learner"] != initial for r in results]
        apart = all(not (changed[a] & changed[b]).any()
                    for a in range(len(changed)) for b in range(a + 1, len(changed)))
        if apart:
            fail("after step 1 each rank changed only its own shard and the ranks now hold "
                 "different weights: no rank received the others' shards.",
                 fix="all-gather every bucket's shards (all_gather_single) and copy them back into the "
                     "parameters.")
    fail(f"after step {step + 1} the ranks hold different weights: some rank ended the step "
         f"without every shard.", fix="all-gather them and copy them back into the parameters.")


def _diagnose_schedule(results: list, world_size: int) -> None:
    """Were the reduce-scatters launched during the backward, each as soon as its bucket was
    full, asynchronously, and waited for before the optimizer stepped?"""
    __tracebackhide__ = True
    for s, buckets, names in ((s, r["buckets"], r["trainable"]) for r in results
                              for s in r["steps"]):
        log = s["log"]
        launches = [e for e in log if e[0] == "launch"]
        if not launches:
            return                     # never averaged: the weights will say so
        if not any(e[4] == "backward" for e in launches):
            fail("you reduce-scattered the gradients in step(), after the backward: every full "
                 "gradient was alive at once and nothing overlapped the backward — contract 4: "
                 "a bucket's gradients leave the rank during the backward, once it is full.")
        grads = [i for i, e in enumerate(log) if e[0] == "grad"]
        if all(log.index(e) > grads[-1] for e in launches):
            fail("every reduce-scatter was launched at the end of the backward, after the last "
                 "gradient arrived: nothing overlapped — contract 4: a bucket leaves the rank as "
                 "soon as it is full, not when the backward is over.")
        _diagnose_bucket_order(log, buckets, names)
        blocking = [e for e in launches if e[4] == "backward" and not e[3]]
        if blocking:
            fail("a reduce-scatter inside the backward was blocking (no async_op=True): the "
                 "backward stopped until the network was done, so nothing overlapped — "
                 "contract 4: the backward does not wait for the network.")
        waited_at = {e[1]: i for i, e in enumerate(log) if e[0] == "wait"}
        for i, e in enumerate(log):
            if e[0] != "launch" or e[4] != "backward":
                continue
            later = [j for j in grads if j > i]
            if later and e[1] in waited_at and waited_at[e[1]] < later[0]:
                fail("you wait() for each reduce-scatter right after launching it: the "
                     "backward stops there as it would for a blocking call, so nothing "
                     "overlaps — contract 4: the backward does not wait for the network.")
        steps_at = [i for i, e in enumerate(log) if e[0] == "inner_step"]
        if steps_at:
            unwaited = [e[1] for e in launches if e[3] and
                        (e[1] not in waited_at or waited_at[e[1]] > steps_at[0])]
            if unwaited:
                fail(f"{len(unwaited)} asynchronous reduce-scatter(s) had not been waited for "
                     f"when the inner optimizer stepped: until wait() returns, the shard's "
                     f"gradient need not hold the average yet (contract 3).")


def _diagnose_bucket_order(log: list, buckets: list, names: list) -> None:
    """Each bucket launched when, and only when, all of its gradients had arrived (in
    whatever order they came): a launch at an arrival that left its bucket incomplete is an
    early one; a complete bucket not launched before the next arrival is a late one."""
    __tracebackhide__ = True
    arrived, launches = [], 0
    for e in log:
        if e[0] == "grad":
            full = sum(all(i in arrived for i in b) for b in buckets)
            if full > launches:
                fail(f"{full} bucket(s) had all their gradients but only {launches} "
                     f"reduce-scatter(s) had been launched when the next gradient came: a "
                     f"bucket was launched later than when it was full (contract 4: as soon "
                     f"as it is full).")
            arrived.append(e[2])
        elif e[0] == "launch" and e[4] == "backward":
            launches += 1
            last = arrived[-1] if arrived else None
            k = next((k for k, b in enumerate(buckets) if last in b), None)
            if k is None:
                continue
            missing = [i for i in buckets[k] if i not in arrived]
            if not missing or sum(all(i in arrived for i in b) for b in buckets) >= launches:
                continue                  # this launch is a full bucket's
            if buckets[k][-1] == last:
                _early(k, names[last], names[missing[0]], [names[i] for i in buckets[k]])
            fail(f"a reduce-scatter was launched at the arrival of {names[last]} while "
                 f"bucket {k} still waited for {', '.join(names[i] for i in missing)}: "
                 f"contract 4 launches a bucket once it is full, not before.")


def _most_in_flight(log: list) -> int:
    """The most asynchronous reduce-scatters launched and not yet waited for at once."""
    open_, most = set(), 0
    for e in log:
        if e[0] == "launch" and e[3]:
            open_.add(e[1])
            most = max(most, len(open_))
        elif e[0] == "wait":
            open_.discard(e[1])
    return most


def _diagnose_memory(results: list, world_size: int, opt_name: str) -> str:
    """The weights and the schedule are right; how much gradient memory was alive at once?"""
    __tracebackhide__ = True
    limit = 4 * _live_limit(world_size)
    total = 4 * sum(_trainable_numels())
    worst = max((s for r in results for s in r["steps"]), key=lambda s: s["peak"])
    if worst["peak"] > limit:
        where = worst["where"]
        path = max(where, key=where.get)
        ends = worst["end_where"]
        log = worst["log"]
        if ends.get("p.grad"):
            fail(f"{ends['p.grad']} bytes of full gradients were still in p.grad when the "
                 f"backward ended: a bucket's gradients, once copied into its buffer, stayed "
                 f"alive a second time in p.grad — contract 5 counts them there too.")
        moment, pgrad = worst.get("moment", ("arrival",)), where.get("p.grad", 0)
        flying = worst.get("flying_bytes", 0)
        new = worst["peak"] - pgrad - flying - where.get("a full gradient kept elsewhere", 0)
        if path == "a full gradient kept elsewhere":
            fail(f"{where[path]} bytes of full gradients were kept alive by a reference outside "
                 f"p.grad and outside your object: contract 5 counts a gradient wherever it is "
                 f"kept alive.")
        waits_in_backward = [e for e in log[:log.index(("backward_done",))] if e[0] == "wait"]
        if not waits_in_backward:
            fail(f"every bucket's padded gradient buffer stayed alive until step() "
                 f"({where[path]} bytes in {path} at the peak, limit {limit}): no "
                 f"reduce-scatter was waited for during the backward, and a collective not "
                 f"waited for keeps its buffer — contract 5 allows about two buckets alive.")
        most = _most_in_flight(log)
        if moment[0] != "arrival" and pgrad and flying and new > 0:
            at = f"at line {moment[-1]} of your {moment[1]}()" if moment[0] == "line" else \
                f"when you called wait() on reduce-scatter {moment[1] + 1}" \
                if moment[0] == "wait" else f"when you launched reduce-scatter {moment[1] + 1}"
            if most > 1:
                fail(f"{at}, {worst['peak']} bytes of gradients were alive (limit {limit}, about "
                     f"two buckets), and {most} bucket reduce-scatters were in flight at once: "
                     f"the older bucket's padded buffer, still in flight ({flying} B), the new "
                     f"bucket's buffer, already filled ({new} B), and the new bucket's "
                     f"gradients, still in p.grad ({pgrad} B) — you copy a bucket while the one "
                     f"launched before it is not yet waited for, so for as long as its p.grad "
                     f"lives beside its copy, three buckets' worth are alive together, where "
                     f"contract 5 allows about two.")
            fail(f"{at}, {worst['peak']} bytes of gradients were alive (limit {limit}, about two "
                 f"buckets): the old bucket's padded buffer, still in flight ({flying} B), the "
                 f"new bucket's buffer, already filled ({new} B), and the new bucket's "
                 f"gradients, still in p.grad ({pgrad} B) — you copied the new bucket before "
                 f"waiting for the old one: for as long as its p.grad lives beside its copy, "
                 f"three buckets' worth are alive together, where contract 5 allows about two.",
                 fix="wait for the old bucket and let go of its buffer before you build the "
                     "new one, and free the new bucket's p.grad once it is copied.")
        if worst["in_flight"] > 1:
            fail(f"{worst['in_flight']} bucket reduce-scatters were in flight at once at the "
                 f"peak ({worst['peak']} bytes of gradients alive, limit {limit}): each keeps "
                 f"its buffer alive until it is waited for, besides the bucket filling in "
                 f"p.grad — contract 5 allows about two buckets alive.")
        owned = {k: v for k, v in where.items() if k.startswith("self")}
        local = {k: v for k, v in where.items() if k.startswith("`")}
        if not owned and len(local) > 1 and moment[0] == "line":
            held = ", ".join(f"{k} ({v} B)" for k, v in local.items())
            fail(f"at line {moment[-1]} of your {moment[1]}(), {worst['peak']} bytes of "
                 f"gradients were alive (limit {limit}, about two buckets): "
                 f"{pgrad} B in p.grad and, in your local variables, {held} — a local variable "
                 f"keeps its tensor alive until your function returns, so every intermediate "
                 f"copy of a bucket weighs as long as the bucket's buffer does.")
        owned = owned or where
        path = max(owned, key=owned.get)
        fail(f"{path} still held {where[path]} bytes of gradients at the peak (limit {limit}, "
             f"about two buckets): contract 5 counts whatever your object keeps — a buffer "
             f"whose reduce-scatter is over, or a copy or view per parameter, still weighs.")
    kept = max((s for r in results for s in r["steps"]), key=lambda s: s["after_step"])
    if kept["after_step"]:
        path = max(kept["after_where"], key=kept["after_where"].get)
        fail(f"after step() {path} still held {kept['after_where'][path]} bytes of gradient "
             f"buffers, kept into the next step: contract 5 — between steps nothing but "
             f"self.shard.grad.")
    return (f"{worst['peak']} of {total} B on {world_size} ranks ({opt_name}, buckets of "
            f"{BUCKET_CAP} B)")
