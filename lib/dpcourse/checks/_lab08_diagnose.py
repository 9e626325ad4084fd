"""How lab08's checks tell one wrong ZeroTwo from another: the cases they run (the model, its
frozen and tied parameters, the configurations, the memory limit), and the diagnosis that turns
what the learner's code did on the ranks — its shard bounds, an exception, its weights after
each step, its schedule of reduce-scatters, the gradient memory alive at each arrival — into
the one sentence that names its mistake.

:mod:`dpcourse.checks.lab08` holds the public checks and the workers that run the learner's
code; it calls these after each launch. Kept apart so that each file holds one idea: running
the learner's code, and reading what it did.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from . import fail

ALIGN_BYTES = 16     # every rank's piece starts on a 16-byte boundary of its bucket's vector


def _piece_numel(numel: int, world_size: int, element_size: int) -> int:
    """The length of every rank's piece of a bucket of ``numel`` numbers: equal pieces that
    cover it, each a whole number of ``ALIGN_BYTES`` units, as short as those allow."""
    unit = max(1, ALIGN_BYTES // element_size)
    return -(-numel // (world_size * unit)) * unit


def _bounds_problem(got, numel, world_size, element_size, sixteen: bool = False) -> None:
    """Name what is wrong with every rank's (start, end) for one (numel, world size, element
    size): the rule it breaks, with the numbers, never the formula. ``sixteen``: on every case
    the pieces were the smallest equal ones rounded up to 16 *numbers*."""
    __tracebackhide__ = True
    size = _piece_numel(numel, world_size, element_size)
    unit = max(1, ALIGN_BYTES // element_size)
    where = (f"for numel={numel} numbers of {element_size} B on {world_size} ranks you gave "
             f"{got}")
    expected = [(r * size, (r + 1) * size) for r in range(world_size)]
    if got == expected:
        return
    first = got[0][1] - got[0][0]
    if world_size > 1 and all(s == r * got[0][1] and e == got[0][1]
                              for r, (s, e) in enumerate(got)):
        fail(f"{where}: that is (start, length), so every rank's second number is the same "
             f"{got[0][1]}.", fix="return (start, end), end exclusive.")
    if sorted(got) != got and all(e - s == first for s, e in got) and \
            sorted(got) == [(r * first, (r + 1) * first) for r in range(world_size)]:
        fail(f"{where}: rank r must own the r-th piece — all_gather_single puts rank r's "
             f"piece at position r.")
    if world_size > 1 and got[:-1] == [(r * first, (r + 1) * first)
                                       for r in range(world_size - 1)] and \
            got[-1] == ((world_size - 1) * first, numel) and numel < world_size * first:
        fail(f"{where}: the last piece is clipped at numel, so it is shorter than the others — "
             f"a reduce-scatter and an all-gather move pieces of one size, one per rank (the "
             f"padding is what a piece may run into).")
    floor = numel // world_size
    if numel % world_size and got == [(r * floor, (r + 1) * floor) for r in range(world_size)]:
        fail(f"{where}: the pieces are equal but too short — together they cover "
             f"{floor * world_size} of the {numel} numbers, and the last {numel % world_size} "
             f"belong to no rank: every number must have an owner.")
    for r in range(world_size - 1):
        if got[r][1] < got[r + 1][0]:
            fail(f"{where}: numbers {got[r][1]}..{got[r + 1][0] - 1} between rank {r} and rank "
                 f"{r + 1} belong to no rank — end is exclusive, and rank {r}'s end stops short "
                 f"of rank {r + 1}'s start.", fix="rank r ends where rank r + 1 starts.")
        if got[r][1] > got[r + 1][0]:
            fail(f"{where}: rank {r} and rank {r + 1} both own numbers {got[r + 1][0]}.."
                 f"{got[r][1] - 1} — pieces must not overlap.")
    if got[0][0] != 0:
        fail(f"{where}: numbers 0..{got[0][0] - 1} belong to no rank (the first piece starts at "
             f"{got[0][0]}).", fix="rank 0 starts at 0.")
    sizes = sorted({e - s for s, e in got})
    if len(sizes) > 1:
        fail(f"{where}: piece sizes {sizes} — a reduce-scatter and an all-gather move pieces of "
             f"one size, one per rank.")
    n = sizes[0]
    if n * world_size < numel:
        fail(f"{where}: pieces of {n} cover {n * world_size} of the {numel} numbers — the last "
             f"belong to no rank: every number must have an owner.")
    if n % unit:
        at = f"rank 1's piece starts at number {n}, byte {n * element_size}" if world_size > 1 \
            else f"the next bucket's piece in self.shard would start at byte {n * element_size}"
        if n == -(-numel // world_size) and world_size > 1:
            fail(f"{where}: the pieces are equal, touch and own every number, but {at} of the "
                 f"vector, which is not on a {ALIGN_BYTES}-byte boundary — the smallest equal "
                 f"pieces are not yet pieces that all start on one.",
                 fix=f"make each piece's length a whole number of {ALIGN_BYTES}-byte units.")
        vector = -(-numel // unit) * unit
        if n == -(-vector // world_size):
            fail(f"{where}: you padded the vector to {vector} numbers ({vector * element_size} B, "
                 f"a whole number of {ALIGN_BYTES}-byte units), but cut in {world_size} its "
                 f"pieces are {n} numbers ({n * element_size} B) each, so rank 1's piece "
                 f"starts at byte {n * element_size} — not on a {ALIGN_BYTES}-byte boundary: it "
                 f"is where each piece starts that must be on one, not where the vector ends.",
                 fix=f"make each piece's length a whole number of {ALIGN_BYTES}-byte units.")
        fail(f"{where}: pieces of {n} numbers of {element_size} B: {at}, which is not on a "
             f"{ALIGN_BYTES}-byte boundary — every piece must start on one.",
             fix=f"make each piece's length a whole number of {ALIGN_BYTES}-byte units.")
    if n > size:
        shorter, smallest = n - unit, -(-numel // world_size)
        if sixteen and element_size > 1 and n == -(-smallest // ALIGN_BYTES) * ALIGN_BYTES:
            fail(f"{where}: every piece starts on a {ALIGN_BYTES}-byte boundary and every number "
                 f"is owned, but each piece is a multiple of {ALIGN_BYTES} *numbers* "
                 f"({ALIGN_BYTES * element_size} B) — the boundary is in bytes, and pieces "
                 f"{n - size} numbers shorter would start on it too: that padding is sent by "
                 f"every collective, in every step.")
        fail(f"{where}: every piece starts on a {ALIGN_BYTES}-byte boundary and every number is "
             f"owned, but pieces {unit} numbers shorter ({shorter}) would be too — each extra "
             f"number per piece is padding sent by every collective, in every step.")
    fail(f"{where}: rank r's piece must be the r-th of {world_size} equal pieces that start at "
         f"0, touch, cover all {numel} numbers and each start on a {ALIGN_BYTES}-byte boundary.")


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


_GLOO_PREFIX = re.compile(r"\[rank\d+\]:\[\w+ [\d:.]+ [\w.]+:\d+\]\s*")


_DTYPE_WHY = ("a tensor made with torch.zeros/torch.empty/torch.tensor without dtype= takes "
              "torch's default dtype, which this check sets to float64, not the parameters' "
              "(and without device=, on a GPU it would sit on the CPU, where NCCL cannot send "
              "it): contract 6, every tensor you make follows the parameters' device and "
              "dtype.")


def _raised(rank: int, summary: str) -> None:
    """The learner's code raised on ``rank``: say so, with a hint where the error says which
    mistake it was."""
    __tracebackhide__ = True
    summary = _GLOO_PREFIX.sub("", summary.strip().splitlines()[0]).rstrip(".")
    counted = re.search(r"lab08-count (\d+) (\d+) (\d+) ([\d,]+) ([\d,]+) ([\d,]+|-) \| ",
                        summary)
    if counted:
        start = summary.rfind("RuntimeError: ", 0, counted.start())
        summary = summary[:start if start >= 0 else counted.start()] + summary[counted.end():]
        if not re.search(r"lab08-(?!early)", summary):
            _counted(rank, counted, summary)
    found = re.search(r"lab08-early (\d+) (\d+) (\S+) (\S+) (\S+) \| (.*)", summary)
    if found:
        step, k = int(found.group(1)), int(found.group(2))
        _early(k, found.group(3), found.group(4), found.group(5).split(","),
               f"your code raised on rank {rank} in step {step}'s backward "
               f"({found.group(6).rstrip('.')}): ")
    found = re.search(r"lab08-reread (\d+) \| (.*)", summary)
    if found:
        fail(f"your code raised on rank {rank} ({found.group(2).rstrip('.')}) after it had "
             f"looped over params again once it was used up: params is model.parameters(), a "
             f"generator, which yields the parameters once — every later pass over it finds "
             f"no parameter, so what you built from that pass was empty.",
             fix="turn params into a list once (list(params)) and loop over the list.")
    found = re.search(r"lab08-misaligned (piece|offset) (\d+) (\d+) (\d+)", summary)
    if found:
        kind, n, size, world_size = found.group(1), *(int(found.group(i)) for i in (2, 3, 4))
        if kind == "piece":
            fail(f"your code raised on rank {rank}: a reduce-scatter's input cut in {world_size} "
                 f"gives pieces of {n} numbers ({n * size} B), so rank 1's piece starts at byte "
                 f"{n * size} of the bucket's buffer — not on a {ALIGN_BYTES}-byte boundary: "
                 f"contract 2, a bucket is cut into shard_bounds' pieces.",
                 fix="cut each bucket with your shard_bounds, given the parameters' element "
                     "size, and pad the buffer to world_size of those pieces.")
        fail(f"your code raised on rank {rank}: a reduce-scatter's output is the slice of "
             f"self.shard.grad that starts at number {n}, byte {n * size} — not on a "
             f"{ALIGN_BYTES}-byte boundary, though every bucket's piece so far was a whole "
             f"number of {ALIGN_BYTES}-byte units: this slice does not start where the earlier "
             f"buckets' pieces end in self.shard (contract 2).",
             fix="check where each bucket's slice starts in self.shard (its offset): right "
                 "after the earlier buckets' pieces.")
    found = re.search(r"lab08-swapped (\w+) (\d+) (\d+) (\d+)", summary)
    if found:
        _swapped(rank, found.group(1), *(int(found.group(i)) for i in (2, 3, 4)))
    found = re.search(r"lab08-(unpadded|out|gather) (\d+) (\d+)(?: (\d+))?", summary)
    if found:
        kind, a, b, c = found.group(1), int(found.group(2)), int(found.group(3)), found.group(4)
        if kind == "unpadded":
            fail(f"your code raised on rank {rank}: a reduce-scatter's input has {a} numbers, "
                 f"which do not split into {b} equal pieces.",
                 fix="pad each bucket's flat vector with zeros to world_size × its shard size before "
                     "the reduce-scatter.")
        if kind == "out":
            fail(f"your code raised on rank {rank}: a reduce-scatter's output has {a} numbers "
                 f"but its input of {b} gives each of the {c} ranks {b // int(c)}: the output slice of "
                 f"self.shard.grad is the wrong size.",
                 fix="check where each bucket's slice starts in self.shard (its offset) and that it is "
                     "one shard long.")
        fail(f"your code raised on rank {rank}: an all-gather of {a} numbers per rank writes "
             f"into {b}, not {a * int(c)}.",
             fix="make its output world_size times the piece each rank sends (and send one "
                 "bucket's whole shard slice).")
    found = re.search(r"lab08-dtype (\w+) torch\.(\w+) torch\.(\w+)", summary)
    if found or ("assign a gradient" in summary and "dtype" in summary):
        if found:
            op = found.group(1).replace("_", "-")
            what = f"{'an' if op[0] in 'aeiou' else 'a'} {op} got a {found.group(2)} tensor"
        else:
            what = "self.shard.grad was given another dtype than self.shard"
        fail(f"your code raised on rank {rank}: {what} while the parameters are float32 — "
             f"{_DTYPE_WHY}")
    hint = ""
    if "doesn't require gradient" in summary or "does not require grad" in summary:
        hint = (" — the model has a frozen parameter (requires_grad=False): it never gets a "
                "gradient, so give it no hook and no place in a bucket")
    elif "non-leaf" in summary:
        hint = (" — build self.shard from detached values (p.detach()), then copy it: a new "
                "leaf tensor, not a result of the model's autograd graph")
    elif "assign a gradient" in summary:
        hint = (" — self.shard.grad must be exactly the size of self.shard: this rank's slice "
                "of every bucket, one after the other")
    elif "'NoneType'" in summary:
        hint = (" — a p.grad was None where you read it: a frozen parameter "
                "(requires_grad=False) never gets a gradient, so leave it out of the buckets, "
                "and a gradient you already dropped is gone")
    elif "size" in summary.lower() or "shape" in summary.lower():
        hint = (" — every rank's piece must be the same size: pad each bucket's flat vector to "
                "a multiple of the world size before a collective, and make the output of "
                "all_gather_single world_size times a shard")
    fail(f"your code raised on rank {rank}: {summary}{hint}.")


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


def _swapped(rank: int, function: str, out_numel: int, in_numel: int, world_size: int) -> None:
    """A reduce-scatter whose output is world_size times its input, or an all-gather whose
    input is world_size times its output: the two arguments the wrong way round."""
    __tracebackhide__ = True
    if out_numel > in_numel:                          # a reduce-scatter
        fail(f"your code raised on rank {rank}: {function}(output, input) takes the output "
             f"first, and yours got an output of {out_numel} numbers and an input of "
             f"{in_numel} — an output {world_size} × its input ({world_size} ranks) is the "
             f"padded bucket and its slice of self.shard.grad passed the wrong way round: the "
             f"input is the whole padded bucket, the output this rank's piece of it.",
             fix=f"call {function}(this bucket's slice of self.shard.grad, the padded bucket, "
                 f"async_op=True).")
    fail(f"your code raised on rank {rank}: {function}(output, input) takes the output first, "
         f"and yours got an output of {out_numel} numbers and an input of {in_numel} — an input "
         f"{world_size} × its output ({world_size} ranks) is the gathered vector and this rank's "
         f"piece passed the wrong way round: the input is this rank's piece, the output the "
         f"vector of all {world_size} pieces.",
         fix=f"call {function}(the padded vector of world_size pieces, this rank's slice of "
             f"self.shard).")


def _counted(rank: int, found: re.Match, summary: str) -> None:
    """The learner's hook raised in a backward, and its wrapper keeps one count of arrived
    gradients per bucket (``lab08._raise_with_counts``): name a full-bucket test that is off by
    one arrival, either way."""
    __tracebackhide__ = True
    step, arrived, launched_before = (int(found.group(i)) for i in (1, 2, 3))
    sizes, counts = ([int(x) for x in found.group(i).split(",")] for i in (4, 5))
    before = None if found.group(6) == "-" else [int(x) for x in found.group(6).split(",")]
    past = [i for i, (c, n) in enumerate(zip(counts, sizes)) if c > n]
    if step > 1 and launched_before == 0 and before == sizes:
        moved = [i for i, (c, b) in enumerate(zip(counts, before)) if c != b]
        i = moved[0] if moved else 0
        fail(f"your code raised on rank {rank} in step {step}'s backward ({summary}). In step "
             f"{step - 1} every gradient arrived and your count reached each bucket's size — "
             f"self.arrived held {before} for buckets of {sizes} parameters — yet no bucket was "
             f"reduce-scattered: your test of a full bucket took a count equal to the size for "
             f"'not yet', so the last arrival, the one that completes the bucket, never "
             f"launched it. In step {step} the first arrival in bucket {i} took its count "
             f"past the size ({sizes[i] + 1} of {sizes[i]}), and that launched the bucket "
             f"while its other p.grad were still None.",
             fix="a bucket is full at the arrival that makes its count equal its number of "
                 "parameters: that arrival must launch it (and set the count back).")
    early = [i for i, (c, n) in enumerate(zip(counts, sizes)) if 0 < c < n]
    if not past and early and not any(c == n for c, n in zip(counts, sizes)):
        i = early[0]
        fail(f"your code raised on rank {rank} in step {step}'s backward, after {arrived} "
             f"gradient{'s' * (arrived != 1)} had arrived ({summary}): no bucket was full yet — "
             f"self.arrived held {counts} for buckets of {sizes} parameters — but a bucket was "
             f"launched, and its gradients read, at bucket {i}'s arrival {counts[i]} of "
             f"{sizes[i]}: your test of a full bucket lets a bucket through before its last "
             f"gradient has come.",
             fix="launch a bucket only at the arrival that makes its count equal its number of "
                 "parameters.")


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
