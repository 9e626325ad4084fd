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


def _check_empty_batch(scatter, n: int = 4) -> None:
    """A batch of no samples: no chunk can be non-empty, and the step's mean loss over 0
    samples would be nan (0/0), so the contract refuses it with a ValueError."""
    __tracebackhide__ = True
    X = torch.empty(0, 3)
    try:
        got = scatter(X, n)
    except NotImplementedError:
        raise
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - reported as one sentence
        fail(f"scatter(X, {n}) on a batch of 0 samples raised {type(exc).__name__} ({exc}): an "
             f"accident of the arithmetic, not the refusal the contract asks for, so a caller "
             f"that handles a bad batch (ValueError) does not catch it and the message does not "
             f"say the batch is empty.",
             fix="test for an empty batch before any arithmetic on B and raise ValueError "
                 "saying the batch is empty.")
    shown = [c.shape[0] for c in got] if isinstance(got, (list, tuple)) and all(
        isinstance(c, torch.Tensor) for c in got) else type(got).__name__
    fail(f"scatter(X, {n}) on a batch of 0 samples returned {shown} instead of refusing it: "
         f"there is no non-empty chunk to give any device, and the step's mean loss over 0 "
         f"samples would be nan (0/0), so the contract refuses an empty batch.",
         fix="raise ValueError, saying the batch is empty, when X has no samples.")


def _check_no_devices(scatter, b: int = 4) -> None:
    """Zero devices (``n_devices = 0``): no chunk has a device to run on, so the contract
    refuses it with a ValueError, as it refuses an empty batch."""
    __tracebackhide__ = True
    X = torch.arange(b * 3, dtype=torch.float32).reshape(b, 3)
    try:
        got = scatter(X, 0)
    except NotImplementedError:
        raise
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - reported as one sentence
        fail(f"scatter(X, 0) on a batch of {b} samples raised {type(exc).__name__} ({exc}): an "
             f"accident of the arithmetic or of a torch call, not the refusal the contract asks "
             f"for, so a caller that handles a bad argument (ValueError) does not catch it and "
             f"the message does not say there are no devices.",
             fix="test for a device count below 1 before using it and raise ValueError saying "
                 "there are no devices.")
    shown = [c.shape[0] for c in got] if isinstance(got, (list, tuple)) and all(
        isinstance(c, torch.Tensor) for c in got) else type(got).__name__
    fail(f"scatter(X, 0) on a batch of {b} samples returned {shown} instead of refusing it: with "
         f"no devices no chunk has a device to run on, so the contract refuses n_devices = 0.",
         fix="raise ValueError, saying there are no devices, when n_devices is below 1.")


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
    return passed("gather concatenates the outputs along dim 0 in device order")
