"""Checks for lab02: DataParallel's step by hand (scatter, replicas, gather, summed gradients).

The learner writes ``scatter(X, n_devices)``, ``gather(outputs)`` and
``dp_forward_backward(model, X, y, n_devices)``; each check runs them on small inputs, compares
with the reference (``dpcourse.dp`` and the plain module on the whole batch) and, when the
numbers match a known wrong answer, names it. tests/test_lab02_checks.py proves each one.
"""

from __future__ import annotations

import copy
import threading
import time

import torch
import torch.nn.functional as F

from . import fail, passed, recorded

__all__ = ["check_scatter", "check_gather", "check_dp_forward_backward",
           "check_threaded_apply"]


def _tensor_list(result, what: str) -> list[torch.Tensor]:
    __tracebackhide__ = True
    if isinstance(result, torch.Tensor) or not isinstance(result, (list, tuple)):
        fail(f"{what} must return a list of tensors (one per device), got "
             f"{type(result).__name__}.")
    for r in result:
        if not isinstance(r, torch.Tensor):
            fail(f"{what} must return a list of tensors, but one item is a {type(r).__name__}.")
    return list(result)


@recorded
def check_scatter(scatter) -> None:
    """``scatter(X, n_devices)`` must split X along dim 0 into contiguous, non-empty chunks in
    order, as ``nn.DataParallel`` does: at most n chunks, none larger than ceil(B/n), and at
    least as many as ``torch.chunk`` makes (which the real class uses: 6 samples on 4 devices
    are 3 chunks of 2, and the step then runs on 3 devices). A balanced split with n chunks when
    the batch allows it (2, 2, 1, 1) is accepted too; an empty chunk or an error is not."""
    __tracebackhide__ = True
    # Even and uneven splits, one sample per device, and batches that run out before the
    # devices do (torch.chunk gives fewer chunks than devices: (6, 4), (5, 4), (2, 3)).
    for b, n in ((8, 2), (10, 4), (6, 3), (7, 2), (3, 3), (6, 4), (5, 4), (2, 3)):
        X = torch.arange(b * 3, dtype=torch.float32).reshape(b, 3)
        fewest = len(torch.chunk(X, n))   # what nn.DataParallel uses
        most = min(n, b)
        biggest = -(-b // n)
        try:
            chunks = scatter(X.clone(), n)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as one sentence
            if b == n:
                fail(f"scatter refused a batch of {b} samples on {n} devices ({type(exc).__name__}: "
                     f"{exc}), but one sample per device is a valid split: refuse only batches "
                     f"smaller than the number of devices (check < against <=).")
            if fewest < n:
                fail(f"scatter raised {type(exc).__name__} for a batch of {b} on {n} devices "
                     f"({exc}), but nn.DataParallel does not refuse a batch that runs out before "
                     f"the devices do: it returns fewer chunks and the step uses fewer devices.")
            fail(f"scatter(X, {n}) raised {type(exc).__name__}: {exc}")
        chunks = _tensor_list(chunks, "scatter")
        if any(c.dim() != 2 for c in chunks):
            fail(f"scatter changed the number of dimensions (got shapes "
                 f"{[tuple(c.shape) for c in chunks]} from {tuple(X.shape)}): split, do not reshape.")
        if (len(chunks) > 1 and all(c.shape[0] == b for c in chunks)
                and sum(c.shape[1] for c in chunks) == 3):
            fail("scatter split along dim 1 (the features) instead of dim 0 (the batch): each "
                 "device must get whole samples.")
        if any(c.shape[1] != 3 for c in chunks):
            fail(f"scatter returned chunks shaped {[tuple(c.shape) for c in chunks]}; each chunk "
                 f"must keep every feature of its samples (shape (k, 3) here).")
        sizes = [c.shape[0] for c in chunks]
        if len(chunks) > n:
            fail(f"scatter(X, {n}) returned {len(chunks)} chunk(s) (sizes {sizes}) for {n} "
                 f"devices: at most one chunk per device.")
        if any(s == 0 for s in sizes):
            fail(f"scatter(X, {n}) gave a device an empty chunk (sizes {sizes}) for a batch of "
                 f"{b}: a replica must not run on no samples, so return only non-empty chunks "
                 f"(nn.DataParallel then uses fewer devices).")
        total = sum(sizes)
        if total < b:
            fail(f"scatter lost {b - total} of {b} samples (chunk sizes {sizes}): the "
                 f"remainder must go to some device.")
        if total > b:
            fail(f"scatter returned {total} samples from a batch of {b}: a sample was copied to "
                 f"two devices.")
        if len(chunks) < fewest:
            fail(f"scatter(X, {n}) returned {len(chunks)} chunk(s) (sizes {sizes}) for a batch of "
                 f"{b}: it left devices idle that nn.DataParallel would use ({fewest} chunks), "
                 f"so each device must get one chunk while the batch lasts.")
        if max(sizes) > biggest:
            fail(f"scatter's chunks are unbalanced (sizes {sizes} for {b} samples on {n} "
                 f"devices): the slowest device sets the step's pace, so no chunk may hold more "
                 f"than ceil({b}/{n}) = {biggest} samples.")
        assert fewest <= len(chunks) <= most
        joined = torch.cat(chunks)
        if torch.equal(joined, X):
            continue
        k = len(chunks)
        strided = torch.cat([X[i::k] for i in range(k)])
        if torch.equal(joined, strided):
            fail("scatter took every n-th sample (X[i::n]) instead of contiguous slices: "
                 "DataParallel gives each device one contiguous slice, so that gathering the "
                 "outputs in device order puts them back in the order of y.")
        fail("scatter's chunks, concatenated in device order, are not the original batch: split "
             "X along dim 0 into contiguous pieces without reordering them.")
    return passed("scatter splits the batch along dim 0 into contiguous chunks, at most one per "
                  "device and none empty, also when the batch runs out before the devices do")


@recorded
def check_gather(gather) -> None:
    """``gather(outputs)`` must concatenate the per-device outputs along dim 0, in order."""
    __tracebackhide__ = True
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


def _forward_spy(model) -> list:
    """Record (module id, batch size) at every forward of ``model`` and of its deep copies.

    A plain function (not a bound method) as the hook: ``copy.deepcopy`` copies a module's hook
    table but keeps functions as they are, so every replica reports into this one list.
    """
    calls: list = []

    def hook(module, args):
        x = args[0] if args else None
        calls.append((id(module), x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else None))

    model.register_forward_pre_hook(hook)
    return calls


@recorded
def check_dp_forward_backward(dp_forward_backward) -> None:
    """After ``dp_forward_backward(model, X, y, n_devices)`` the original model's gradients must
    equal the plain model's on the whole batch (mean cross-entropy), the returned loss must be
    its loss, and the forward must have run on ``n_devices`` copies, each on its own chunk.

    Tried with 16 samples on 4 devices, 10 samples on 3 (chunks of 4, 4 and 2) and 6 samples on
    4 (torch.chunk gives 3 chunks of 2: fewer chunks than devices), so an answer tied to one
    device count, to equal chunks or to one copy per device fails.
    """
    __tracebackhide__ = True
    for n_devices, batch in ((4, 16), (3, 10), (4, 6)):
        _check_dp_once(dp_forward_backward, n_devices, batch)
    passed("DataParallel by hand on 4 and 3 devices (even and uneven chunks, and a batch of 6 "
           "on 4): each copy ran on its chunk, and the gradients and loss equal the plain "
           "model's on the whole batch")


def _check_dp_once(dp_forward_backward, n: int, batch: int) -> None:
    __tracebackhide__ = True
    from ..models import SmallCNN

    torch.manual_seed(n)
    model = SmallCNN(width=4)
    X = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    sizes = [c.shape[0] for c in torch.chunk(X, n)]

    ref_model = copy.deepcopy(model)
    ref_loss = F.cross_entropy(ref_model(X), y)
    ref_loss.backward()
    ref = _grads(ref_model)

    learner = copy.deepcopy(model)
    calls = _forward_spy(learner)
    try:
        loss = dp_forward_backward(learner, X.clone(), y.clone(), n)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        if len(sizes) < n:
            fail(f"on a batch of {batch} over {n} devices, where scatter gives {len(sizes)} "
                 f"chunks, dp_forward_backward raised {type(exc).__name__} ({exc}): make one "
                 f"copy per chunk, not one per device.")
        fail(f"dp_forward_backward raised {type(exc).__name__}: {exc}")

    # Did it do data parallelism at all: one forward per chunk, on different copies, on chunks?
    seen = [b for _, b in calls]
    if batch in seen:
        fail(f"the model ran on the whole batch of {batch} (forward batch sizes {seen}): "
             f"scatter X first and run each copy on its own chunk.")
    if len(calls) not in (len(sizes), min(n, batch)):
        fail(f"{len(calls)} forward pass(es) for {n} devices (batch sizes {seen}): run each "
             f"copy once, on its chunk.")
    if len({m for m, _ in calls}) != len(calls):
        fail(f"the {len(calls)} chunks ran through {len({m for m, _ in calls})} model object(s): "
             f"make one copy per chunk (copy.deepcopy) and run copy i on chunk i — each device "
             f"holds its own replica, which is what DataParallel is.")

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
        if _close(got, [r / n for r in ref]):
            fail(f"the gradients are {n} times too small: you averaged the replicas' gradients, "
                 f"but with one mean loss over the gathered batch each replica's gradient is "
                 f"already its share, so they must be summed.")

        def per_chunk(combine):
            m = copy.deepcopy(model)
            losses = [F.cross_entropy(m(xc), yc) for xc, yc in zip(torch.chunk(X, n),
                                                                   torch.chunk(y, n))]
            combine(losses).backward()
            return _grads(m)

        if _close(got, per_chunk(sum)):
            fail(f"the gradients are about {n} times too big: a mean loss per chunk, summed over "
                 f"the replicas, counts the batch {n} times — compute one loss on the gathered "
                 f"outputs.")
        if _close(got, per_chunk(lambda ls: sum(ls) / len(ls))):
            fail(f"you averaged the chunks' mean losses, but the chunks are uneven ({sizes}): "
                 f"the samples of the short chunk weigh more. Compute one mean loss on the "
                 f"gathered outputs.")
        # Only replica 0's share: the gradient of chunk 0's part of the global mean loss.
        only0 = copy.deepcopy(model)
        (F.cross_entropy(only0(X[:sizes[0]]), y[:sizes[0]], reduction="sum") / batch).backward()
        if _close(got, _grads(only0)):
            fail("the gradients are replica 0's alone: the gradients of all replicas must be "
                 "summed onto the original parameters, not just the first one's copied.")
        fail(f"the original model's gradients differ from the plain model's on the whole batch "
             f"({batch} samples, {n} devices); check that scatter and gather keep the order of "
             f"the samples and that every replica's gradient is added.")
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


# --- stretch: the copies' forwards in real threads -----------------------------------------

class _Timed(torch.nn.Module):
    """A stand-in replica: sleeps (releasing the GIL, as torch kernels do), records when it
    ran and in which thread, and returns its input times a factor that identifies it."""

    def __init__(self, factor: float, delay: float, log: list, fail_with: str | None = None):
        super().__init__()
        self.factor, self.delay, self.log, self.fail_with = factor, delay, log, fail_with
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        t0 = time.perf_counter()
        time.sleep(self.delay)
        if self.fail_with:
            raise ValueError(self.fail_with)
        self.log.append((self.factor, threading.get_ident(), t0, time.perf_counter()))
        return x * self.factor * self.w


@recorded
def check_threaded_apply(threaded_apply) -> None:
    """Stretch: ``threaded_apply(replicas, inputs)`` runs ``replicas[i](inputs[i])`` in one
    thread per replica, at the same time, and returns the outputs in replica order, with
    autograd on or off as the caller had it, and any replica's error raised to the caller."""
    __tracebackhide__ = True
    n = 3
    log: list = []
    # Replica 0 is the slowest, so the order the threads finish in is the reverse of the order
    # of the replicas.
    reps = [_Timed(i + 1, 0.15 * (n - i), log) for i in range(n)]
    inputs = [torch.full((2,), 10.0 ** i) for i in range(n)]
    try:
        out = threaded_apply(reps, inputs)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"threaded_apply raised {type(exc).__name__}: {exc}")
    if not isinstance(out, (list, tuple)) or len(out) != n:
        fail(f"threaded_apply must return a list with one output per replica, got "
             f"{type(out).__name__}" + (f" of length {len(out)}" if hasattr(out, "__len__") else "")
             + ".")
    if any(o is None for o in out):
        fail("some outputs are still None: threaded_apply returned before its threads finished "
             "— join every thread before reading the results.")
    want = [reps[i].factor * inputs[i] for i in range(n)]
    if not all(isinstance(o, torch.Tensor) and torch.equal(o.detach(), w) for o, w in zip(out, want)):
        if all(isinstance(o, torch.Tensor) and torch.equal(o.detach(), w)
               for o, w in zip(out, want[::-1])):
            fail("the outputs are in the order the threads finished, not in replica order: "
                 "store each result at its replica's index (results[i] = ...).")
        fail("output i is not replicas[i](inputs[i]): give each thread its own index and keep "
             "the pairs together.")
    threads = {tid for _, tid, _, _ in log}
    if threads == {threading.get_ident()}:
        fail("the replicas ran one after another in the caller's thread: start one thread per "
             "replica (threading.Thread(target=..., args=(i,)), or a ThreadPoolExecutor).")
    # Checked before the thread count: a finished thread's id can be reused by the next one.
    spans = sorted((t0, t1) for _, _, t0, t1 in log)
    if not any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1)):
        fail("the replicas never ran at the same time: start every thread (or submit every "
             "task) before waiting for any of them, then join them all.")
    if len(threads) < n:
        fail(f"the {n} replicas ran in {len(threads)} thread(s), so some waited for others: give "
             f"each replica a thread of its own.")
    if not all(o.requires_grad for o in out):
        fail("the outputs carry no autograd graph: grad mode is per thread in torch, so a thread "
             "must switch it to the caller's setting (torch.set_grad_enabled(...)).")
    with torch.no_grad():
        quiet = threaded_apply([_Timed(1, 0.0, []) for _ in range(2)],
                               [torch.ones(2), torch.ones(2)])
    if any(o.requires_grad for o in quiet):
        fail("called under torch.no_grad(), the threads still recorded a graph: grad mode is "
             "per thread in torch — read torch.is_grad_enabled() in the caller and set it in "
             "each thread with torch.set_grad_enabled(...).")
    broken = [_Timed(1, 0.0, []), _Timed(2, 0.0, [], fail_with="replica 1 broke")]
    try:
        threaded_apply(broken, [torch.ones(2), torch.ones(2)])
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        if "replica 1 broke" not in str(exc) and "replica 1 broke" not in str(exc.__cause__):
            fail(f"when a replica fails, the caller should see its error; got "
                 f"{type(exc).__name__}: {exc}")
    else:
        fail("a replica raised an error in its thread and threaded_apply returned as if "
             "nothing happened: keep the exception and raise it in the caller after join.")
    passed(f"threaded_apply ran {n} replicas at the same time in {n} threads, kept their order, "
           f"the caller's grad mode, and their errors")
