"""Lab 02 §1-§2: ``check_scatter`` (the chunk sizes the learner's design choice names, an empty
batch and no devices refused clearly) and ``check_gather``. Re-exported by
:mod:`dpcourse.checks.lab02`.
"""

from __future__ import annotations

import torch

from . import fail, passed, recorded
from .. import dp as reference
from ._lab02_common import _OWN, _not_yours, _refuse_library
from .lab01 import library_calls


# The two answers (both accepted) to the choice lab02 §1 leaves to the learner: how scatter
# sizes the chunks when N does not divide B. "like DataParallel": ceil(B/N) per device until the
# batch runs out (torch.chunk's sizes, which the real class uses; 6 on 4 -> 2, 2, 2);
# "balanced": sizes that differ by at most one over min(N, B) devices, the B mod k extra samples
# on the first chunks (6 on 4 -> 2, 2, 1, 1).
CHUNK_SIZES = ("like DataParallel", "balanced")


def _sizes_for(policy: str, b: int, n: int) -> list[int]:
    if policy == "like DataParallel":
        return [len(c) for c in torch.chunk(torch.empty(b), n)]
    k = min(n, b)
    return [b // k + (i < b % k) for i in range(k)]


def _tensor_list(result, what: str) -> list[torch.Tensor]:
    __tracebackhide__ = True
    if isinstance(result, torch.Tensor) or not isinstance(result, (list, tuple)):
        fail(f"{what} must return a list or tuple of tensors (one per device), got "
             f"{type(result).__name__}.")
    for r in result:
        if not isinstance(r, torch.Tensor):
            fail(f"{what} must return a list or tuple of tensors, but one item is a "
                 f"{type(r).__name__}.")
    return list(result)


@recorded
def check_scatter(scatter, sizes: str | None = None) -> None:
    """``scatter(X, n_devices)`` must split X along dim 0 into contiguous, non-empty chunks in
    order, as ``nn.DataParallel`` does: at most n chunks, none larger than ceil(B/n), and at
    least as many as ``torch.chunk`` makes (which the real class uses: 6 samples on 4 devices
    are 3 chunks of 2, and the step then runs on 3 devices). A balanced split with n chunks when
    the batch allows it (2, 2, 1, 1: the extra samples on the first chunks) is accepted too;
    an empty chunk or an error is not. A list or a tuple of chunks is accepted. An empty batch
    (no samples) must be refused with a ValueError (a nan loss over 0 samples otherwise), and so
    must zero devices (``n_devices = 0``: no chunk has a device to go to).

    ``sizes`` is the learner's choice of chunk sizes (one of :data:`CHUNK_SIZES`; both are
    accepted); when given, the chunks must have the sizes it names. The library's
    ``dp.scatter`` is refused."""
    __tracebackhide__ = True
    policy = sizes  # (``sizes`` names each split's chunk sizes below)
    if policy is not None and policy not in CHUNK_SIZES:
        fail(f"your choice of chunk sizes must be {CHUNK_SIZES[0]!r} or {CHUNK_SIZES[1]!r} (how "
             f"scatter sizes the chunks), got {policy!r}.")
    _refuse_library(scatter, reference.scatter, "scatter", _OWN)
    # Even and uneven splits, one sample per device, and batches that run out before the
    # devices do (torch.chunk gives fewer chunks than devices: (6, 4), (5, 4), (2, 3)).
    # One device (4, 1): the whole batch is its one chunk.
    for b, n in ((8, 2), (10, 4), (6, 3), (7, 2), (3, 3), (6, 4), (5, 4), (2, 3), (4, 1)):
        X = torch.arange(b * 3, dtype=torch.float32).reshape(b, 3)
        fewest = len(torch.chunk(X, n))   # what nn.DataParallel uses
        most = min(n, b)
        biggest = -(-b // n)
        try:
            with library_calls(reference.scatter) as called:
                chunks = scatter(X.clone(), n)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as one sentence
            if b == n:
                fail(f"scatter refused a batch of {b} samples on {n} devices ({type(exc).__name__}: "
                     f"{exc}), but one sample per device is a valid split.",
                     fix="refuse nothing the contract allows (check < against <=).")
            if fewest < n:
                fail(f"scatter raised {type(exc).__name__} for a batch of {b} on {n} devices "
                     f"({exc}), but nn.DataParallel does not refuse a batch that runs out before "
                     f"the devices do: it returns fewer chunks and the step uses fewer devices.",
                     fix="return fewer chunks when the batch runs out.")
            fail(f"scatter(X, {n}) raised {type(exc).__name__}: {exc}")
        _not_yours("scatter", called, _OWN)
        chunks = _tensor_list(chunks, "scatter")
        if any(c.dim() != 2 for c in chunks):
            fail(f"scatter changed the number of dimensions (got shapes "
                 f"{[tuple(c.shape) for c in chunks]} from {tuple(X.shape)}).",
                 fix="split, do not reshape.")
        if (len(chunks) > 1 and all(c.shape[0] == b for c in chunks)
                and sum(c.shape[1] for c in chunks) == 3):
            fail("scatter split along dim 1 (the features) instead of dim 0 (the batch), so no "
                 "device got a whole sample.", fix="split along dim 0.")
        if any(c.shape[1] != 3 for c in chunks):
            fail(f"scatter returned chunks shaped {[tuple(c.shape) for c in chunks]}, not every "
                 f"feature of their samples (shape (k, 3) here).",
                 fix="cut along dim 0 only.")
        sizes = [c.shape[0] for c in chunks]
        if len(chunks) > n:
            fail(f"scatter(X, {n}) returned {len(chunks)} chunk(s) (sizes {sizes}) for {n} "
                 f"devices, more chunks than devices to run them.",
                 fix="at most one chunk per device.")
        if any(s == 0 for s in sizes):
            fail(f"scatter(X, {n}) gave a device an empty chunk (sizes {sizes}) for a batch of "
                 f"{b}: a replica must not run on no samples.",
                 fix="return only non-empty chunks (nn.DataParallel then uses fewer devices).")
        total = sum(sizes)
        if total < b:
            fail(f"scatter lost {b - total} of {b} samples (chunk sizes {sizes}): the "
                 f"remainder of B / N went to no device.",
                 fix="give the remainder to some device.")
        if total > b:
            fail(f"scatter returned {total} samples from a batch of {b}: a sample was copied to "
                 f"two devices.", fix="let the chunks' bounds meet without overlapping.")
        if len(chunks) < fewest:
            fail(f"scatter(X, {n}) returned {len(chunks)} chunk(s) (sizes {sizes}) for a batch of "
                 f"{b}: it left devices idle that nn.DataParallel would use ({fewest} chunks).",
                 fix="give each device one chunk while the batch lasts.")
        if max(sizes) > biggest:
            fail(f"scatter's chunks are unbalanced (sizes {sizes} for {b} samples on {n} "
                 f"devices): the device with the most samples sets the step's pace, and "
                 f"{max(sizes)} is more than the ceil({b}/{n}) = {biggest} it could be.",
                 fix=f"no chunk may hold more than ceil(B/N) samples.")
        assert fewest <= len(chunks) <= most
        joined = torch.cat(chunks)
        if torch.equal(joined, X):
            if policy is not None and sizes != _sizes_for(policy, b, n):
                if policy == "balanced" and sorted(sizes) == sorted(_sizes_for(policy, b, n)):
                    fail(f"you decided on 'balanced' chunk sizes and scatter(X, {n}) on a batch "
                         f"of {b} gave {sizes}: balanced, but the larger chunks come after "
                         f"smaller ones, where the lab's rule for 'balanced' puts the "
                         f"{b % min(n, b)} extra sample(s) on the first chunks "
                         f"({_sizes_for(policy, b, n)}).",
                         fix="give the B mod k extra samples to the first chunks, one each.")
                fail(f"you decided on {policy!r} chunk sizes, but scatter(X, {n}) on a batch of "
                     f"{b} gave {sizes}, and {policy!r} gives {_sizes_for(policy, b, n)}: your "
                     f"function and your choice disagree.",
                     fix="change the function or the choice, so that they say the same.")
            continue
        k = len(chunks)
        strided = torch.cat([X[i::k] for i in range(k)])
        if torch.equal(joined, strided):
            fail("scatter took every n-th sample (X[i::n]) instead of contiguous slices, so "
                 "gathering the outputs in device order does not put them back in the order "
                 "of y.", fix="give each device one contiguous slice.")
        fail("scatter's chunks, concatenated in device order, are not the original batch.",
             fix="split X along dim 0 into contiguous pieces without reordering them.")
    _check_empty_batch(scatter)
    _check_no_devices(scatter)
    said = f", with {policy!r} sizes as you decided" if policy else ""
    return passed(f"scatter splits the batch along dim 0 into contiguous chunks, at most one per "
                  f"device and none empty, also when the batch runs out before the devices "
                  f"do{said}, and refuses an empty batch and zero devices with a ValueError")


def _check_refused(scatter, X, n: int, what: str, why: str, cause: str, fix: str) -> None:
    """``scatter(X, n)`` on an input the contract refuses (an empty batch, zero devices): it
    must raise ValueError. ``what`` names the input in the sentence, ``why`` says why the
    contract refuses it, ``cause`` what else than the refusal an error raised there is, and
    ``fix`` the two fixes' common end."""
    __tracebackhide__ = True
    call = f"scatter(X, {n}) on a batch of {X.shape[0]} samples"
    try:
        got = scatter(X, n)
    except NotImplementedError:
        raise
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - reported as one sentence
        fail(f"{call} raised {type(exc).__name__} ({exc}): {cause}, not the refusal the "
             f"contract asks for, so a caller that handles a bad {what} (ValueError) does not "
             f"catch it and the message does not say {why[0]}.",
             fix=f"test for {fix[0]} before {fix[1]} and raise ValueError saying {why[0]}.")
    shown = [c.shape[0] for c in got] if isinstance(got, (list, tuple)) and all(
        isinstance(c, torch.Tensor) for c in got) else type(got).__name__
    fail(f"{call} returned {shown} instead of refusing it: {why[1]}",
         fix=f"raise ValueError, saying {why[0]}, when {fix[2]}.")


def _check_empty_batch(scatter, n: int = 4) -> None:
    """A batch of no samples: no chunk can be non-empty, and the step's mean loss over 0
    samples would be nan (0/0), so the contract refuses it with a ValueError."""
    __tracebackhide__ = True
    _check_refused(
        scatter, torch.empty(0, 3), n, "batch",
        why=("the batch is empty",
             "there is no non-empty chunk to give any device, and the step's mean loss over 0 "
             "samples would be nan (0/0), so the contract refuses an empty batch."),
        cause="an accident of the arithmetic",
        fix=("an empty batch", "any arithmetic on B", "X has no samples"))


def _check_no_devices(scatter, b: int = 4) -> None:
    """Zero devices (``n_devices = 0``): no chunk has a device to run on, so the contract
    refuses it with a ValueError, as it refuses an empty batch."""
    __tracebackhide__ = True
    _check_refused(
        scatter, torch.arange(b * 3, dtype=torch.float32).reshape(b, 3), 0, "argument",
        why=("there are no devices",
             "with no devices no chunk has a device to run on, so the contract refuses "
             "n_devices = 0."),
        cause="an accident of the arithmetic or of a torch call",
        fix=("a device count below 1", "using it", "n_devices is below 1"))


@recorded
def check_gather(gather) -> None:
    """``gather(outputs)`` must concatenate the per-device outputs along dim 0, in order."""
    __tracebackhide__ = True
    torch.manual_seed(0)
    outputs = [torch.randn(3, 10) for _ in range(3)]  # equal sizes: a wrong dim still runs
    expected = torch.cat(outputs, dim=0)
    _refuse_library(gather, reference.gather, "gather", _OWN)
    try:
        with library_calls(reference.gather) as called:
            got = gather([o.clone() for o in outputs])
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"gather raised {type(exc).__name__}: {exc}")
    _not_yours("gather", called, _OWN)
    if not isinstance(got, torch.Tensor):
        fail(f"gather must return one tensor, got {type(got).__name__}.")
    if got.dim() == 2 and got.shape[0] == 3:
        fail(f"gather concatenated along dim 1 (shape {tuple(got.shape)}) instead of dim 0: the "
             f"outputs of the devices are more samples, not more features.",
             fix="the result must be shaped (9, 10): join along dim 0.")
    if got.dim() == 3:
        fail(f"gather stacked the outputs into a new dimension (shape {tuple(got.shape)}), "
             f"but the devices' outputs are more rows of one batch.",
             fix="concatenate them along dim 0 into one (9, 10) batch.")
    if got.shape != expected.shape:
        fail(f"gather returned shape {tuple(got.shape)}, not the {tuple(expected.shape)} of "
             f"the devices' outputs one after another.",
             fix="concatenate the outputs along dim 0.")
    if not torch.equal(got, expected):
        if torch.equal(got, torch.cat(outputs[::-1])):
            fail("gather put the outputs in reverse device order, so the rows no longer line "
                 "up with y.", fix="keep device 0's first.")
        fail("gather returned the right shape but not the outputs concatenated in device order.",
             fix="join the outputs along dim 0, device 0's first, without changing their "
                 "values.")
    _check_gather_tuples(gather)
    return passed("gather concatenates the outputs along dim 0 in device order, and outputs "
                  "that are tuples position by position, as nn.DataParallel's gather does")


def _check_gather_tuples(gather) -> None:
    """Outputs that are tuples (a model returning ``(logits, features)``), on 3 devices with
    chunks of 3, 3 and 2: nn.DataParallel's gather (torch/nn/parallel/scatter_gather.py,
    ``gather_map``: ``type(out)(map(gather_map, zip(*outputs)))``) returns one tuple, each
    position's tensors concatenated along dim 0. A list in its place is accepted (the caller
    unpacks it the same way)."""
    __tracebackhide__ = True
    torch.manual_seed(1)
    sizes = (3, 3, 2)
    outputs = [(torch.randn(k, 10), torch.randn(k, 4)) for k in sizes]
    want = [torch.cat([o[i] for o in outputs]) for i in range(2)]
    seen = (f"the {len(sizes)} devices each returned a tuple (logits, features), shaped "
            f"(k, 10) and (k, 4) for chunks of {', '.join(map(str, sizes))}")
    try:
        got = gather([tuple(t.clone() for t in o) for o in outputs])
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported as one sentence
        fail(f"gather raised {type(exc).__name__} ({exc}) where {seen}: it treats each "
             f"device's output as one tensor, but a model may return several, and "
             f"nn.DataParallel hands the caller every one of them, each as one batch.",
             fix="when the outputs are tuples, gather the tensors at each position of the "
                 "tuples as you gather single tensors, and return those in a tuple.")
    if isinstance(got, torch.Tensor):
        if got.shape == want[0].shape and torch.equal(got, want[0]):
            fail(f"gather returned the logits alone, shape {tuple(got.shape)}, where {seen}: "
                 f"the features (position 1 of every tuple) were dropped, and the caller "
                 f"that unpacks (logits, features) gets nothing to unpack.",
                 fix="return a tuple: one gathered tensor per position of the devices' tuples.")
        fail(f"gather returned one tensor of shape {tuple(got.shape)} where {seen}: the caller "
             f"unpacks (logits, features) from the output of nn.DataParallel, one batch each.",
             fix="return a tuple: one gathered tensor per position of the devices' tuples.")
    if not isinstance(got, (tuple, list)):
        fail(f"gather returned a {type(got).__name__} where {seen}: nn.DataParallel returns a "
             f"tuple of the same length as each device's.",
             fix="return a tuple: one gathered tensor per position of the devices' tuples.")
    if len(got) == sum(len(o) for o in outputs):
        fail(f"gather returned {len(got)} tensors where {seen}: the devices' tuples one after "
             f"another, so the caller that unpacks two takes device 0's logits and features "
             f"for the batch's (and more than two fails to unpack).",
             fix="join the tensors position by position: all the logits into one batch, all "
                 "the features into another.")
    if len(got) == len(outputs):
        fail(f"gather returned {len(got)} items, one per device, where {seen}: the caller gets "
             f"the devices' outputs back, not the batch's logits and features.",
             fix="join the tensors position by position: all the logits into one batch, all "
                 "the features into another.")
    if len(got) != 2:
        fail(f"gather returned {len(got)} items where {seen}: nn.DataParallel returns a tuple "
             f"of 2, one batch per position.",
             fix="return one gathered tensor per position of the devices' tuples.")
    for i, (g, w) in enumerate(zip(got, want)):
        name = ("logits", "features")[i]
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or not torch.equal(g, w):
            shown = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            fail(f"gather's item {i} is {shown} where {seen}: not the devices' {name} joined "
                 f"along dim 0 in device order, shape {tuple(w.shape)}.",
                 fix=f"join the tensors at position {i} of the tuples as you join single "
                     f"outputs.")
