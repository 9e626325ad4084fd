"""How lab08's ZeroTwo check reads an exception the learner's code raised on a rank: the
error's first line, with a hint where it says which mistake it was — the arguments of a
collective the wrong way round, a full-bucket test off by one arrival (the counts a wrapper
keeps, ``lab08._raise_with_counts``), a bucket launched before its gradients arrived, a
buffer of the wrong dtype.

:mod:`dpcourse.checks.lab08` runs the learner's code and calls :func:`_raised` when a rank
raised (and re-exports it); :mod:`dpcourse.checks._lab08_diagnose` reads the ranks that
finished, and holds the two sentences both need (a buffer of the wrong dtype, a bucket
launched early).
"""

from __future__ import annotations

import re

from . import fail
from ._lab08_bounds import ALIGN_BYTES
from ._lab08_diagnose import _DTYPE_WHY, _early

_GLOO_PREFIX = re.compile(r"\[rank\d+\]:\[\w+ [\d:.]+ [\w.]+:\d+\]\s*")


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
