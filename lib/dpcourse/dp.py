"""``nn.DataParallel`` from scratch, on CPU "devices" (lesson 02, lab02).

One step of ``nn.DataParallel(module)(X)`` is four moves, all inside one Python process:

1. :func:`scatter`   split the batch along dim 0 into contiguous chunks, at most one per device;
2. :func:`replicate` copy the module onto every device — *every step*, because the weights
                     changed since the last one;
3. :func:`parallel_apply` run each replica on its chunk, one Python **thread** per device;
4. :func:`gather`    concatenate the outputs on device 0, where the loss is computed.

``loss.backward()`` then runs back through all four: the gradient of each replica's parameters
is **summed** onto the original parameters on device 0 (the backward of a broadcast is a
reduce-add). :func:`data_parallel` chains the four and is checked in tests/test_dp.py and in the
lesson to give the plain module's outputs and gradients on the whole batch.

Here a "device" is a ``torch.device``. On a machine without GPUs every device is the CPU and the
copies are real copies in the same memory, which is enough to see every move and count every
byte; with GPUs (``devices_for(n)``) the same code puts chunks and replicas on ``cuda:0..n-1``.

Why it is slow, each point measurable with this module and timed by :mod:`dpcourse.dp_costs`
(lesson 02 measures them):

* one process: the threads share the GIL, so the Python parts of N forwards take turns;
* the weights travel from device 0 to N-1 devices every step, and N-1 gradient copies travel
  back to device 0. Done as this module does it, one plain copy per device, that is *a naive
  parameter server* on device 0 moving T = 2(N-1)K numbers per step for K parameters
  (:func:`parameter_server_traffic`; :class:`TrafficCounter` counts the copies this
  implementation really makes). The real class moves the same tensors with torch's collective
  helpers instead (``comm.broadcast_coalesced`` out, ``comm.reduce_add_coalesced`` back, whose
  ``reduce_add`` runs an NCCL reduce when it can), so device 0's link need not carry all of it;
* device 0 also holds the gathered outputs and computes the loss alone.

:func:`real_data_parallel` says what the real ``nn.DataParallel`` does *on this machine*: with
2 or more GPUs it runs for real; with 0 or 1 it quietly calls the wrapped module and nothing
else (no scatter, no replicas, no threads). Lab 02's answers, measured on this module, are in
:mod:`dpcourse.dp_answers`.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

__all__ = [
    "devices_for",
    "scatter",
    "Broadcast",
    "replicate",
    "parallel_apply",
    "gather",
    "data_parallel",
    "TrafficCounter",
    "parameter_server_traffic",
    "RealDataParallelReport",
    "real_data_parallel",
]


# --------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------


def devices_for(n: int, kind: str | None = None) -> list[torch.device]:
    """``n`` devices for the from-scratch DataParallel: ``cuda:0..n-1`` or ``n`` × cpu.

    ``kind`` None picks CUDA when there are at least ``n`` GPUs, the CPU otherwise. Asking for
    ``kind="cuda"`` with more devices than GPUs is an error (one sentence, not a CUDA trace).
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the number of devices must be a positive int, got {n!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind is None:
        kind = "cuda" if gpus >= n else "cpu"
    if kind == "cuda":
        if n > gpus:
            raise ValueError(f"asked for {n} CUDA devices but this machine has {gpus}; "
                             f"use kind='cpu' (or None) to simulate them on the CPU")
        return [torch.device("cuda", i) for i in range(n)]
    if kind == "cpu":
        return [torch.device("cpu")] * n
    raise ValueError(f"kind must be None, 'cpu' or 'cuda', got {kind!r}")


def _as_devices(devices) -> list[torch.device]:
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices_for(devices)
    devs = [torch.device(d) for d in devices]
    if not devs:
        raise ValueError("need at least one device")
    return devs


# --------------------------------------------------------------------------------------------
# Traffic accounting: every number that crosses from one device to another
# --------------------------------------------------------------------------------------------


@dataclass
class TrafficCounter:
    """Counts the numbers (tensor elements) copied by :func:`replicate` (weights out of device 0)
    and by its backward (gradients into device 0). Use as a context manager::

        with TrafficCounter() as tc:
            loss = F.cross_entropy(data_parallel(model, X, 4), y); loss.backward()
        tc.params_out, tc.grads_in      # both (N-1)·K for K parameters

    Shown in lesson 02, §"Why it is slow".
    """

    params_out: int = 0
    grads_in: int = 0
    replicate_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def total(self) -> int:
        return self.params_out + self.grads_in

    def __enter__(self) -> "TrafficCounter":
        _COUNTERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _COUNTERS.remove(self)

    def _add(self, what: str, n: int) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + n)


_COUNTERS: list[TrafficCounter] = []


def _count(what: str, n: int) -> None:
    for c in list(_COUNTERS):
        c._add(what, n)


def parameter_server_traffic(n_devices: int, n_params: int) -> int:
    """Numbers through device 0 in one step of a naive parameter server: T = 2(N-1)K.

    N-1 copies of the K weights go out (replicate), N-1 gradients of K numbers come back
    (the reduce onto device 0), each copied directly to or from device 0 as this module does.
    The cost grows linearly with N, which is why a ring all-reduce (lesson 06) beats it. (The
    real ``nn.DataParallel`` brings the gradients back with an NCCL collective when NCCL is
    available, which need not route every gradient through device 0's link.)

    Shown in lesson 02, §"Why it is slow".
    """
    if n_devices < 1 or n_params < 0:
        raise ValueError(f"need n_devices >= 1 and n_params >= 0, got {n_devices}, {n_params}")
    return 2 * (n_devices - 1) * n_params


# --------------------------------------------------------------------------------------------
# 1. scatter
# --------------------------------------------------------------------------------------------


def scatter(X: torch.Tensor, devices) -> list[torch.Tensor]:
    """Split ``X`` along dim 0 into contiguous chunks, chunk i on device i.

    Same sizes as the real one (``torch.chunk``, which ``comm.scatter`` uses when no chunk sizes
    are given): ceil(B/N) per chunk, the last one smaller. ``torch.chunk`` never makes an empty
    chunk, so it can return *fewer* than N chunks (B=6 on 4 devices gives 2, 2, 2; B=2 on 3
    gives 1, 1); like ``nn.DataParallel.forward``, which replicates onto
    ``device_ids[:len(inputs)]``, the caller then uses only the first ``len(chunks)`` devices.
    Differentiable: gradients flow back from the chunks to ``X``.

    Shown in lesson 02, §"Lab 02: DataParallel's step by hand".
    """
    devs = _as_devices(devices)
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"scatter needs a tensor, got {type(X).__name__}")
    if X.dim() == 0:
        raise ValueError("scatter needs a batch (a tensor with a dim 0), got a scalar")
    if X.shape[0] == 0:
        raise ValueError("scatter needs at least one sample, got an empty batch")
    chunks = list(torch.chunk(X, len(devs), dim=0))
    return [c.to(d) for c, d in zip(chunks, devs)]


# --------------------------------------------------------------------------------------------
# 2. replicate
# --------------------------------------------------------------------------------------------


class Broadcast(torch.autograd.Function):
    """Copy tensors to every device; backward *sums* the copies' gradients onto the source.

    This pair — broadcast forward, reduce-add backward — is what makes the gradients of all
    replicas land, summed, on the original parameters.

    ``backward`` answers part of lab 02, so lesson 02 shows the ``forward`` alone in §2 and the
    whole class folded, after the lab's pointer.

    Shown in lesson 02, §2 (``forward``); lesson 02, §"Lab 02: DataParallel's step by hand".
    """

    @staticmethod
    def forward(ctx, devices, *tensors):
        ctx.n_dev = len(devices)
        ctx.n_t = len(tensors)
        ctx.src = [t.device for t in tensors]
        out = []
        for i, d in enumerate(devices):
            for t in tensors:
                if i == 0 and d == t.device:
                    # Replica 0 shares the original's storage, as in torch's
                    # comm.broadcast_coalesced (the first device's outputs are the inputs):
                    # autograd hands it a view with this Function as its grad_fn.
                    out.append(t)
                else:
                    out.append(t.detach().to(d, copy=True))
                    if i > 0:  # a copy sent out of device 0 (replica 0's own copy stays home)
                        _count("params_out", out[-1].numel())
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        n_t = ctx.n_t
        summed = []
        for j in range(n_t):
            g = grads[j].to(ctx.src[j])  # replica 0's gradient is already on device 0
            for i in range(1, ctx.n_dev):
                incoming = grads[i * n_t + j].to(ctx.src[j])  # a gradient sent to device 0
                _count("grads_in", incoming.numel())
                g = g + incoming
            summed.append(g)
        return (None, *summed)


def replicate(module: nn.Module, devices) -> list[nn.Module]:
    """One copy of ``module`` per device, its parameters tied to the original by autograd.

    Each replica's parameters are *outputs* of a broadcast (not leaf Parameters): autograd
    carries a backward through any replica back to ``module``'s own parameters (what arrives
    there: ``Broadcast.backward``, lab 02). As in torch's own ``replicate``,
    replica 0 (on the module's device) **shares** the module's storage: its parameters are views
    of the originals and its buffers *are* the module's buffers, so in-place updates on replica 0
    (BatchNorm's running statistics) reach ``module``; the other replicas get copies of the
    buffers, and their updates are lost when the replicas are dropped. Called every step, as the
    real one is.

    Shown in lesson 02, §"Lab 02: DataParallel's step by hand".
    """
    devs = _as_devices(devices)
    if not isinstance(module, nn.Module):
        raise TypeError(f"replicate needs an nn.Module, got {type(module).__name__}")
    for c in _COUNTERS:
        c._add("replicate_calls", 1)
    params = list(module.parameters())
    buffers = list(module.buffers())
    copies = Broadcast.apply(devs, *params) if params else ()
    replicas = []
    for i, d in enumerate(devs):
        # Share the original tensors with the deep copy (memo), so deepcopy only builds the
        # module tree; every parameter and buffer slot is then pointed at its per-device copy
        # below. A fresh memo per replica: deepcopy records the copies it made in the memo, and
        # a memo reused for the next replica would hand back this same module object.
        memo = {id(t): t for t in params + buffers}
        replica = copy.deepcopy(module, memo)
        p_copies = iter(copies[i * len(params):(i + 1) * len(params)])
        for m in replica.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    m._parameters[name] = next(p_copies)
            for name, b in m._buffers.items():
                if b is not None and not (i == 0 and b.device == d):
                    m._buffers[name] = b.detach().to(d, copy=True)
                # (replica 0 on the module's device keeps the module's own buffer: the memo
                # above made the deep copy share it)
        replicas.append(replica)
    return replicas


# --------------------------------------------------------------------------------------------
# 3. parallel_apply
# --------------------------------------------------------------------------------------------


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[torch.Tensor]) -> list:
    """Run ``replicas[i](inputs[i])`` in one thread per replica, like the real one.

    The threads share the GIL: the Python code of the forwards takes turns, and only the time
    spent inside torch kernels (which release the GIL) can overlap. Grad mode is thread-local in
    torch and a new thread starts with it *on*, so each thread switches it to the caller's
    setting — forget that and a caller inside ``torch.no_grad()`` would still get replicas that
    record autograd graphs (memory held for a backward that never comes). An exception in a thread is re-raised here, naming the replica.

    Shown in lesson 02, §"Lab 02: DataParallel's step by hand".
    """
    if len(replicas) != len(inputs):
        raise ValueError(f"{len(replicas)} replicas but {len(inputs)} inputs: need one input "
                         f"chunk per replica")
    grad_enabled = torch.is_grad_enabled()
    results: list = [None] * len(replicas)
    errors: list = [None] * len(replicas)

    def work(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                results[i] = replicas[i](inputs[i])
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[i] = exc

    if len(replicas) == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, exc in enumerate(errors):
        if exc is not None:
            raise RuntimeError(f"replica {i} failed: {type(exc).__name__}: {exc}") from exc
    return results


# --------------------------------------------------------------------------------------------
# 4. gather
# --------------------------------------------------------------------------------------------


def gather(outputs: Sequence[torch.Tensor], target_device=None, dim: int = 0) -> torch.Tensor:
    """Concatenate the replicas' outputs along ``dim`` (the batch) on ``target_device``
    (device 0 by default). Differentiable: the backward sends each chunk's gradient home.

    Shown in lesson 02, §"Lab 02: DataParallel's step by hand".
    """
    if not outputs:
        raise ValueError("gather needs at least one output")
    for o in outputs:
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"gather handles tensor outputs only, got {type(o).__name__}")
    target = torch.device(target_device) if target_device is not None else outputs[0].device
    return torch.cat([o.to(target) for o in outputs], dim=dim)


def data_parallel(module: nn.Module, X: torch.Tensor, devices) -> torch.Tensor:
    """``nn.DataParallel(module)(X)`` on 2+ devices, spelled out (and replicating on 1 too).

    Shown in lesson 02, §4.
    """
    devs = _as_devices(devices)
    chunks = scatter(X, devs)
    replicas = replicate(module, devs[:len(chunks)])  # fewer chunks than devices: fewer replicas
    outputs = parallel_apply(replicas, chunks)
    return gather(outputs, devs[0])


# --------------------------------------------------------------------------------------------
# The real nn.DataParallel on this machine
# --------------------------------------------------------------------------------------------


@dataclass
class RealDataParallelReport:
    """What ``nn.DataParallel`` did here, as observed: ``mode`` is "parallel" when its
    ``replicate`` was called (2+ GPUs), "passthrough" when it was not (it called the module
    itself: with no GPU straight away, with one after its ``scatter`` moved the input to
    cuda:0). ``gpu_count`` is what the observed mode is then compared with."""

    gpu_count: int
    device_ids: list
    mode: str
    replicate_calls: int
    matches_module: bool
    max_abs_diff: float
    scatter_calls: int = 0
    parallel_apply_calls: int = 0

    def explain(self) -> str:
        """One sentence written from the counted calls (``parallel_apply`` is where the real
        class starts its threads, one per replica).

        Shown in lesson 02, §"The real `nn.DataParallel` on this machine".
        """
        counts = (f"scatter {self.scatter_calls}, replicate {self.replicate_calls}, "
                  f"parallel_apply {self.parallel_apply_calls}")
        if self.mode == "parallel":
            return (f"nn.DataParallel ran for real over GPUs {self.device_ids}: its calls were "
                    f"{counts}.")
        threads = ("no parallel_apply, so no threads" if not self.parallel_apply_calls
                   else f"parallel_apply called {self.parallel_apply_calls} time(s)")
        where = ("No CUDA GPU here (torch's own test: any accelerator but MPS) and "
                 "nn.DataParallel has no device_ids" if self.gpu_count == 0
                 else f"With {self.gpu_count} GPU(s), nn.DataParallel")
        return (f"{where}; its calls were {counts}: it called the wrapped module itself, "
                f"{'no replicas' if not self.replicate_calls else 'with replicas'}, {threads}, "
                f"and raised no error.")


def real_data_parallel(module: nn.Module, X: torch.Tensor) -> RealDataParallelReport:
    """Wrap ``module`` in the real ``nn.DataParallel``, run ``X`` through it, and report what it
    did: the calls of its ``scatter``, ``replicate`` and ``parallel_apply`` methods (the last
    is where its threads start) are counted (the mode is read
    from them, not from the number of GPUs), and the output is compared with the module's own
    on the whole batch. With GPUs, ``module`` is moved to cuda:0 (a copy is made; the argument
    is left where it was).

    Shown in lesson 02, §"The real `nn.DataParallel` on this machine".
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    model = copy.deepcopy(module)
    if gpus:
        model = model.to("cuda:0")
        X = X.to("cuda:0")
    wrapped = nn.DataParallel(model)
    calls = {"scatter": 0, "replicate": 0, "parallel_apply": 0}

    def counting(name):
        original = getattr(wrapped, name)

        def count(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return count

    for name in calls:  # an instance attribute shadows the method
        setattr(wrapped, name, counting(name))
    with torch.no_grad():
        out = wrapped(X)
        ref = model(X)
    diff = (out - ref).abs().max().item()
    mode = "parallel" if calls["replicate"] else "passthrough"
    return RealDataParallelReport(gpus, list(wrapped.device_ids), mode, calls["replicate"],
                                  bool(torch.allclose(out, ref, atol=1e-5, rtol=1e-4)), diff,
                                  calls["scatter"], calls["parallel_apply"])


# Split off, and still reachable as dp.NAME (lesson 02 once called them so): the measurements of
# "why it is slow" (dpcourse.dp_costs) and lab 02's answers (dpcourse.dp_answers). Both use the
# step above, so they import this module; a lazy lookup here keeps that from being circular.
def __getattr__(name: str):
    import importlib

    for split_off in ("dp_costs", "dp_answers"):
        module = importlib.import_module(f"{__package__}.{split_off}")
        if name in module.__all__:
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
