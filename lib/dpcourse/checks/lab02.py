"""Checks for lab02: DataParallel's step by hand (scatter, replicas, gather, summed gradients).

The learner writes ``scatter(X, n_devices)``, ``gather(outputs)`` and
``dp_forward_backward(model, X, y, n_devices)``; each check runs them on small inputs, compares
with the reference (``dpcourse.dp`` and the plain module on the whole batch) and, when the
numbers match a known wrong answer, names it. tests/test_lab02_checks.py proves each one.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from . import fail, passed

__all__ = ["check_scatter", "check_gather", "check_dp_forward_backward"]


def _tensor_list(result, what: str) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor) or not isinstance(result, (list, tuple)):
        fail(f"{what} must return a list of tensors (one per device), got "
             f"{type(result).__name__}.")
    for r in result:
        if not isinstance(r, torch.Tensor):
            fail(f"{what} must return a list of tensors, but one item is a {type(r).__name__}.")
    return list(result)


def check_scatter(scatter) -> str:
    """``scatter(X, n_devices)`` must split X along dim 0 into n contiguous, non-empty chunks in
    order (torch.chunk's sizes, or any other contiguous split, are fine)."""
    # Even and uneven splits, and a batch of exactly one sample per device (the boundary).
    for b, n in ((8, 2), (10, 4), (6, 3), (7, 2), (3, 3)):
        X = torch.arange(b * 3, dtype=torch.float32).reshape(b, 3)
        try:
            chunks = scatter(X.clone(), n)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as one sentence
            if b == n:
                fail(f"scatter refused a batch of {b} samples on {n} devices ({type(exc).__name__}: "
                     f"{exc}), but one sample per device is a valid split: refuse only batches "
                     f"smaller than the number of devices (check < against <=).")
            fail(f"scatter(X, {n}) raised {type(exc).__name__}: {exc}")
        chunks = _tensor_list(chunks, "scatter")
        if len(chunks) != n:
            fail(f"scatter(X, {n}) returned {len(chunks)} chunk(s) for {n} devices: each device "
                 f"needs exactly one chunk.")
        if any(c.dim() != 2 for c in chunks):
            fail(f"scatter changed the number of dimensions (got shapes "
                 f"{[tuple(c.shape) for c in chunks]} from {tuple(X.shape)}): split, do not reshape.")
        if all(c.shape[0] == b for c in chunks) and sum(c.shape[1] for c in chunks) == 3:
            fail("scatter split along dim 1 (the features) instead of dim 0 (the batch): each "
                 "device must get whole samples.")
        if any(c.shape[1] != 3 for c in chunks):
            fail(f"scatter returned chunks shaped {[tuple(c.shape) for c in chunks]}; each chunk "
                 f"must keep every feature of its samples (shape (k, 3) here).")
        if any(c.shape[0] == 0 for c in chunks):
            fail(f"scatter(X, {n}) left a device with an empty chunk for a batch of {b}: every "
                 f"device needs at least one sample.")
        total = sum(c.shape[0] for c in chunks)
        if total < b:
            fail(f"scatter lost {b - total} of {b} samples (chunk sizes "
                 f"{[c.shape[0] for c in chunks]}): the remainder must go to some device.")
        if total > b:
            fail(f"scatter returned {total} samples from a batch of {b}: a sample was copied to "
                 f"two devices.")
        joined = torch.cat(chunks)
        if torch.equal(joined, X):
            continue
        strided = torch.cat([X[i::n] for i in range(n)])
        if torch.equal(joined, strided):
            fail("scatter took every n-th sample (X[i::n]) instead of contiguous slices: "
                 "DataParallel gives each device one contiguous slice, so that gathering the "
                 "outputs in device order puts them back in the order of y.")
        fail("scatter's chunks, concatenated in device order, are not the original batch: split "
             "X along dim 0 into contiguous pieces without reordering them.")
    return passed("scatter splits the batch along dim 0 into contiguous chunks, one per device")


def check_gather(gather) -> str:
    """``gather(outputs)`` must concatenate the per-device outputs along dim 0, in order."""
    torch.manual_seed(0)
    outputs = [torch.randn(3, 10) for _ in range(3)]  # equal sizes: a wrong dim still runs
    expected = torch.cat(outputs, dim=0)
    try:
        got = gather([o.clone() for o in outputs])
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"gather raised {type(exc).__name__}: {exc}")
    if not isinstance(got, torch.Tensor):
        fail(f"gather must return one tensor, got {type(got).__name__}.")
    if got.dim() == 2 and got.shape[0] == 3:
        fail(f"gather concatenated along dim 1 (shape {tuple(got.shape)}) instead of dim 0: the "
             f"outputs of the devices are more samples, not more features, so the result must "
             f"be shaped (9, 10).")
    if got.dim() == 3:
        fail(f"gather stacked the outputs into a new dimension (shape {tuple(got.shape)}); "
             f"concatenate them along dim 0 into one (9, 10) batch.")
    if got.shape != expected.shape:
        fail(f"gather returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}: "
             f"concatenate the outputs along dim 0.")
    if not torch.equal(got, expected):
        if torch.equal(got, torch.cat(outputs[::-1])):
            fail("gather put the outputs in reverse device order; keep device 0's first so the "
                 "rows line up with y.")
        fail("gather returned the right shape but not the outputs concatenated in device order.")
    return passed("gather concatenates the outputs along dim 0 in device order")


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _close(a: list, b: list, rtol=1e-4, atol=1e-6) -> bool:
    return all(x is not None and y is not None and x.shape == y.shape
               and torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))


def check_dp_forward_backward(dp_forward_backward, n_devices: int = 4) -> str:
    """After ``dp_forward_backward(model, X, y, n_devices)`` the original model's gradients must
    equal the plain model's on the whole batch (mean cross-entropy), and the returned loss its
    loss."""
    from ..models import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN(width=4)
    X = torch.randn(4 * n_devices, 3, 32, 32)
    y = torch.randint(0, 10, (4 * n_devices,))

    ref_model = copy.deepcopy(model)
    ref_loss = F.cross_entropy(ref_model(X), y)
    ref_loss.backward()
    ref = _grads(ref_model)

    learner = copy.deepcopy(model)
    try:
        loss = dp_forward_backward(learner, X.clone(), y.clone(), n_devices)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"dp_forward_backward raised {type(exc).__name__}: {exc}")
    got = _grads(learner)
    if all(g is None for g in got):
        fail("the original model has no gradients: the replicas' gradients must be summed onto "
             "the original model's parameters (p.grad), which the optimizer steps.")
    if any(g is None for g in got):
        fail("some of the original model's parameters have no gradient: sum the replicas' "
             "gradients onto every parameter.")
    for g, r in zip(got, ref):
        if g.shape != r.shape:
            fail(f"a gradient has shape {tuple(g.shape)} but its parameter has shape "
                 f"{tuple(r.shape)}: sum the replicas' gradients element-wise, parameter by "
                 f"parameter.")
    if not _close(got, ref):
        n = n_devices
        if _close(got, [r / n for r in ref]):
            fail(f"the gradients are {n} times too small: you averaged the replicas' gradients, "
                 f"but with one mean loss over the gathered batch each replica's gradient is "
                 f"already its share, so they must be summed.")
        if _close(got, [r * n for r in ref]):
            fail(f"the gradients are {n} times too big: a mean loss per chunk, summed over the "
                 f"replicas, counts the batch {n} times — compute one loss on the gathered "
                 f"outputs.")
        # Only replica 0's share: the gradient of chunk 0's part of the global mean loss.
        only0 = copy.deepcopy(model)
        b0 = X.shape[0] // n
        (F.cross_entropy(only0(X[:b0]), y[:b0], reduction="sum") / X.shape[0]).backward()
        if _close(got, _grads(only0)):
            fail("the gradients are replica 0's alone: the gradients of all replicas must be "
                 "summed onto the original parameters, not just the first one's copied.")
        fail("the original model's gradients differ from the plain model's on the whole batch; "
             "check that scatter and gather keep the order of the samples and that every "
             "replica's gradient is added.")
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            fail(f"dp_forward_backward must return the loss as a number, got a tensor of shape "
                 f"{tuple(loss.shape)}.")
        loss = loss.item()
    if not isinstance(loss, (int, float)):
        fail(f"dp_forward_backward must return the loss (a number), got {type(loss).__name__}.")
    if abs(loss - ref_loss.item()) > 1e-4 * max(1.0, abs(ref_loss.item())):
        fail(f"the returned loss {loss:.5f} is not the mean loss on the whole batch "
             f"({ref_loss.item():.5f}): compute it on the gathered outputs.")
    return passed(f"DataParallel by hand on {n_devices} devices: gradients and loss equal the "
                  f"plain model's on the whole batch")
