"""Pipeline parallelism from scratch over send/recv (lesson 11).

Tensor parallelism splits every layer across ranks; pipeline parallelism splits the *model*:
rank k holds a contiguous run of layers, a **stage**, and passes activations forward to rank
k+1 and gradients backward to rank k−1, one point-to-point message each. Done with one whole
batch, only one stage would work at a time; so the batch is cut into M **micro-batches** that
follow each other through the stages like cars through a car wash (Huang et al. 2019, GPipe).

This module holds what lesson 11 shows, in this order:

1. the model and its cut: :func:`make_mlp` (a stack of Linear+Tanh blocks, the same on every
   rank from a seed) and :func:`split_stages` (K contiguous stages);
2. the schedules, as lists of ``("F", m)`` / ``("B", m)`` actions per stage:
   :func:`gpipe_schedule` (every forward, then every backward) and :func:`one_f_one_b_schedule`
   (1F1B: K−k−1 warm-up forwards on stage k, then one forward and one backward in turn, as in
   PipeDream-Flush, Narayanan et al. 2021);
3. :func:`run_stage`, which runs one stage's schedule inside its rank: receive, compute, send
   (``dist.isend``, so that two neighbours sending to each other never wait on one another),
   with each micro-batch's loss divided by M so that the gradients **accumulated** over the M
   backwards are the gradients of the whole batch's mean loss. It stamps the start and end of
   every forward and backward (the measured timeline) and counts how many micro-batches'
   activations the stage holds at once;
4. what to compare the run with: :func:`reference_step` (the unsplit model on the whole batch),
   :func:`ideal_bubble` ((K−1)/(M+K−1)), :func:`simulate_timeline` (the schedule played with
   fixed forward and backward times: the ideal Gantt chart), :func:`measured_bubble` (idle
   share of the measured timeline), :func:`peak_in_flight` (min(K−k, M) for 1F1B, M for GPipe);
5. launchers: :func:`run_pipeline` (several schedules and micro-batch counts in one launch,
   every message counted) and :func:`compare_with_torch_pipelining`, which runs torch's own
   ``ScheduleGPipe`` / ``Schedule1F1B`` with ``PipelineStage`` on the same model and batch.

What runs on CPU with gloo (torch 2.14.1, tests/test_pipeline_parallel.py): all of it,
torch's ``torch.distributed.pipelining`` included: ``PipelineStage`` with ``ScheduleGPipe``
and ``Schedule1F1B`` ran 60 times out of 60 on 2, 3 and 4 ranks (M = 4, a loaded 2-core
machine), its gradients within 1e-9 of the unsplit model's every time and bit-identical to
ours where we compared them (the test asserts 1e-6), and its steps send the same 2·M·(K−1)
messages of the same bytes as ours. Its first step adds a few set-up sends
(``_warmup_forward_vote`` and ``_send_meta`` in torch/distributed/pipelining/stage.py). Its
``Schedule1F1B`` refuses fewer micro-batches than stages (``ValueError`` in
``Schedule1F1B.__init__``, torch/distributed/pipelining/schedules.py); ours runs them (every
stage then warms up with all M forwards, as in GPipe).

Measuring the bubble on a CPU: K ranks that compute at once share the machine's cores (2 here),
so a stage's compute time stretches when its neighbours work, and sub-millisecond forwards are
dwarfed by message and Python overheads. ``delay_s`` gives every forward a fixed sleep (and
every backward twice it), as an accelerator computes without taking a CPU core: with 10 ms the
measured bubble on 2 and 4 stages came within a few points of (K−1)/(M+K−1) for M = 2, 4, 8.

Equality: the pipeline's loss and gradients equal the unsplit model's on the whole batch to
``RTOL`` relative and ``ATOL`` absolute (float32; the M micro-batch sums are added in another
order than the one big matrix product, so not bit for bit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "RTOL",
    "ATOL",
    "make_mlp",
    "split_stages",
    "micro_batches",
    "mse_loss",
    "sample_batch",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "SCHEDULES",
    "StageRecord",
    "run_stage",
    "saved_bytes_counter",
    "reference_step",
    "ideal_bubble",
    "simulate_timeline",
    "measured_bubble",
    "peak_in_flight",
    "messages_per_step",
    "PipelineRun",
    "pipeline_worker",
    "run_pipeline",
    "torch_pipelining_worker",
    "compare_with_torch_pipelining",
]

RTOL = 1e-5
ATOL = 1e-6


# --------------------------------------------------------------------------------------------
# 1. The model and its cut
# --------------------------------------------------------------------------------------------


def make_mlp(width: int = 64, blocks: int = 4, seed: int = 0) -> nn.Sequential:
    """A stack of ``blocks`` Linear(width, width) + Tanh blocks, the same on every rank for one
    ``seed``: each rank builds the whole model and keeps its own stage.

    Shown in lesson 11, §3.
    """
    if blocks < 1 or width < 1:
        raise ValueError(f"make_mlp needs blocks >= 1 and width >= 1, got blocks={blocks}, "
                         f"width={width}")
    with torch.random.fork_rng(devices=[]):     # the caller's random state is left alone
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                               for _ in range(blocks)])


def split_stages(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """Cut ``model`` into ``stages`` contiguous stages of (nearly) equal numbers of blocks; the
    first stages take one block more when they do not divide evenly. The stages share the
    model's parameters (slices, not copies).

    Shown in lesson 11, §3.
    """
    n = len(model)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut a model of {n} blocks into {stages} stages: every stage "
                         f"needs at least one block (1 <= stages <= {n}).")
    sizes = [n // stages + (1 if k < n % stages else 0) for k in range(stages)]
    starts = [sum(sizes[:k]) for k in range(stages)]
    return [model[s:s + size] for s, size in zip(starts, sizes)]


def micro_batches(batch: torch.Tensor, m: int) -> list[torch.Tensor]:
    """``batch`` cut into ``m`` equal micro-batches along dimension 0; a batch that ``m`` does
    not divide is refused.

    Shown in lesson 11, §3.
    """
    if m < 1 or batch.shape[0] % m:
        raise ValueError(f"a batch of {batch.shape[0]} cannot be cut into {m} equal "
                         f"micro-batches: choose a number of micro-batches that divides it.")
    return list(batch.chunk(m))


# --------------------------------------------------------------------------------------------
# 2. The schedules
# --------------------------------------------------------------------------------------------


def gpipe_schedule(stages: int, m: int, stage: int) -> list[tuple[str, int]]:
    """GPipe: stage ``stage`` runs the forward of every micro-batch, then every backward.

    Shown in lesson 11, §3.
    """
    _check_stage(stages, m, stage)
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_schedule(stages: int, m: int, stage: int) -> list[tuple[str, int]]:
    """1F1B: stage k first runs K−k−1 warm-up forwards (as many as are in flight below it),
    then one forward and one backward in turn, then the backwards left. The same actions as
    GPipe in another order, so the same gradients; a stage never holds more than K−k
    micro-batches' activations instead of M.

    Shown in lesson 11, §3.
    """
    _check_stage(stages, m, stage)
    warmup = min(stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def _check_stage(stages: int, m: int, stage: int) -> None:
    if stages < 1 or m < 1 or not 0 <= stage < stages:
        raise ValueError(f"a schedule needs stages >= 1, micro-batches >= 1 and 0 <= stage < "
                         f"stages, got stages={stages}, m={m}, stage={stage}")


def _schedule(name: str):
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}: choose one of "
                         f"{', '.join(map(repr, SCHEDULES))}") from None


# --------------------------------------------------------------------------------------------
# 3. One stage inside its rank
# --------------------------------------------------------------------------------------------


@dataclass
class StageRecord:
    """What one stage did in one step: its actions with start and end times (seconds, from
    ``time.perf_counter``, the same clock in every process of one machine), the most
    micro-batches whose activations it held at once, the most bytes autograd held saved for
    the backwards still to come (counted by a ``saved_tensors_hooks`` pack hook, each tensor
    once, the weights left out), and the loss (last stage only; 0.0 elsewhere)."""

    stage: int
    events: list = field(default_factory=list)    # (kind, micro-batch, start, end)
    peak_in_flight: int = 0
    peak_activation_bytes: int = 0
    loss: float = 0.0


def run_stage(module: nn.Module, schedule: list, stage: int, stages: int, *, inputs=None,
              targets=None, shape=None, loss_fn=None, delay_s: float = 0.0) -> StageRecord:
    """Run one stage's ``schedule`` inside its rank (rank = stage).

    A forward receives its input from the stage before (the first stage takes
    ``inputs[m]``), runs the module and sends the output on; the last stage computes
    ``loss_fn(output, targets[m]) / M`` instead. A backward receives the gradient of its output
    from the stage after (the last stage starts from its loss), runs autograd — which **adds**
    to each ``p.grad``, so the M backwards accumulate the whole batch's gradient — and sends
    the gradient of its input back. ``shape`` is the shape of one micro-batch's activation
    between stages. Sends are ``dist.isend``, waited on at the end, so that two neighbours
    that send to each other at the same moment (1F1B) never deadlock; receives block.
    ``delay_s`` adds a sleep to every forward and twice that to every backward: a stand-in for
    an accelerator, which computes without taking one of the machine's CPU cores.

    Shown in lesson 11, §3.
    """
    m_total = sum(1 for kind, _ in schedule if kind == "F")
    first, last = stage == 0, stage == stages - 1
    record = StageRecord(stage)
    held: dict[int, tuple] = {}   # micro-batch -> (input, output): its activations, for backward
    pending = []                  # (work, tensor): a send and the tensor it must keep alive
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    for kind, m in schedule:
        if kind == "F":
            if first:
                x = inputs[m]
            else:
                x = torch.empty(shape)
                dist.recv(x, src=stage - 1)
                x.requires_grad_(True)
            start = time.perf_counter()
            saved: dict[int, int] = {}    # address -> bytes autograd keeps for the backward
            with torch.autograd.graph.saved_tensors_hooks(saved_bytes_counter(saved, weights), _unpack):
                out = module(x)
                if last:
                    out = loss_fn(out, targets[m]) / m_total
            if last:
                record.loss += out.item()
            _device_time(delay_s)
            end = time.perf_counter()
            held[m] = (x, out, sum(saved.values()))
            record.peak_in_flight = max(record.peak_in_flight, len(held))
            record.peak_activation_bytes = max(record.peak_activation_bytes,
                                               sum(h[2] for h in held.values()))
            if not last:
                sent = out.detach()
                pending.append((dist.isend(sent, dst=stage + 1), sent))
        elif kind == "B":
            x, out, _ = held.pop(m)
            grad = None
            if not last:
                grad = torch.empty(shape)
                dist.recv(grad, src=stage + 1)
            start = time.perf_counter()
            out.backward(grad)
            _device_time(2 * delay_s)
            end = time.perf_counter()
            if not first:
                pending.append((dist.isend(x.grad, dst=stage - 1), x.grad))
        else:
            raise ValueError(f"unknown action {kind!r}: a schedule holds ('F', m) and ('B', m)")
        record.events.append((kind, m, start, end))
    for work, _ in pending:
        work.wait()
    if held:
        raise RuntimeError(f"stage {stage}: micro-batches {sorted(held)} ran forward but never "
                           f"backward — the schedule must hold one ('B', m) per ('F', m)")
    return record


def _device_time(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def saved_bytes_counter(saved: dict, weights: set):
    """An autograd pack hook (for ``torch.autograd.graph.saved_tensors_hooks``) that notes in
    ``saved`` the bytes of every tensor autograd keeps for the backward, keyed by its start
    address and counting its own elements (``numel × element_size``, not its storage's): a
    tensor saved twice (a Linear saves its input, which is the Tanh before it's saved output:
    one address) is counted once — two views that start at different places in one storage
    would each count their own elements — and tensors in ``weights`` (the stage's parameters'
    storages) are left out — they are saved too, but held whatever the schedule. So it counts a micro-batch's
    activations, and only them: unlike ``tensor_parallel.activation_memory_worker`` (lesson 11,
    §1), which adds up every saved tensor whose first dimension is the micro-batch, one saved
    twice counted twice.

    Shown in lesson 11, §3.
    """
    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t
    return pack


def _unpack(t):
    return t


# --------------------------------------------------------------------------------------------
# 4. What to compare with
# --------------------------------------------------------------------------------------------


def reference_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn) -> tuple:
    """The unsplit model on the whole batch: (loss, [gradient of every parameter]). The
    pipeline must give the same, to ``RTOL``/``ATOL``.

    Shown in lesson 11, §3.
    """
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def ideal_bubble(stages: int, m: int) -> float:
    """The share of a GPipe step a stage is idle, when every stage takes the same time:
    (K−1)/(M+K−1). With K stages and M micro-batches the step lasts M+K−1 slots, of which
    each stage works M.

    Shown in lesson 11, §3.
    """
    if stages < 1 or m < 1:
        raise ValueError(f"ideal_bubble needs stages >= 1 and m >= 1, got {stages}, {m}")
    return (stages - 1) / (m + stages - 1)


def simulate_timeline(stages: int, m: int, schedule: str = "gpipe", t_forward: float = 1.0,
                      t_backward: float = 2.0) -> list:
    """Play a schedule with fixed times and no communication cost: every action starts as soon
    as its stage is free and its input exists (the forward of micro-batch i on stage k after
    the one on stage k−1; its backward after the one on stage k+1, or after its own forward on
    the last stage). Returns ``[(stage, kind, micro-batch, start, end)]``: the ideal Gantt
    chart, whose bubble is (K−1)/(M+K−1) for both schedules (lesson 11 claims it for the M it
    runs).

    Shown in lesson 11, §3.
    """
    order = [list(_schedule(schedule)(stages, m, k)) for k in range(stages)]
    done: dict[tuple, float] = {}
    free = [0.0] * stages
    out = []
    while any(order):
        progressed = False
        for k in range(stages):
            if not order[k]:
                continue
            kind, i = order[k][0]
            if kind == "F":
                need = (k - 1, "F", i) if k > 0 else None
            else:
                need = (k + 1, "B", i) if k < stages - 1 else (k, "F", i)
            if need is not None and need not in done:
                continue
            start = max(free[k], done[need] if need is not None else 0.0)
            end = start + (t_forward if kind == "F" else t_backward)
            done[(k, kind, i)] = free[k] = end
            out.append((k, kind, i, start, end))
            order[k].pop(0)
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks: no stage can go on")
    return out


def measured_bubble(events: list) -> float:
    """The idle share of a timeline ``[(stage, kind, micro-batch, start, end)]``: 1 − (time
    spent computing, summed over stages) / (stages × the step's duration, first start to last
    end). The ideal timeline gives (K−1)/(M+K−1); a measured one also counts waiting for
    messages and Python's overhead as idle.

    Shown in lesson 11, §3.
    """
    if not events:
        raise ValueError("measured_bubble needs a non-empty timeline")
    stages = {e[0] for e in events}
    span = max(e[4] for e in events) - min(e[3] for e in events)
    busy = sum(e[4] - e[3] for e in events)
    return 1.0 - busy / (len(stages) * span)


def peak_in_flight(schedule: list) -> int:
    """The most micro-batches whose activations a stage holds at once under ``schedule``
    (forward done, backward not yet): M for GPipe on every stage, min(K−k, M) for 1F1B on
    stage k. :func:`run_stage` counts the same while it runs."""
    held = peak = 0
    for kind, _ in schedule:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def messages_per_step(stages: int, m: int) -> int:
    """Point-to-point messages in one step, all stages together: each of the K−1 boundaries
    carries M activations forward and M gradients back, 2·M·(K−1).

    Shown in lesson 11, §3.
    """
    return 2 * m * (stages - 1)


# --------------------------------------------------------------------------------------------
# 5. Launchers
# --------------------------------------------------------------------------------------------


def mse_loss(out, target):
    """The launchers' loss: the mean squared error (a mean, so micro-batches must be equal).

    Shown in lesson 11, §3.
    """
    return ((out - target) ** 2).mean()


def sample_batch(batch: int, width: int, seed: int) -> tuple:
    """The launchers' batch: inputs and targets drawn from ``seed`` (the same on every rank).

    Shown in lesson 11, §3.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen))


@dataclass
class PipelineRun:
    """One (schedule, M) configuration run by :func:`run_pipeline`: the pipeline's loss and
    the reference's, the largest gradient difference (and whether it is within tolerance),
    the measured timeline ``[(stage, kind, micro-batch, start, end)]`` (seconds from the
    step's first start), the measured and ideal bubble, the activations held per stage
    (counted while running), and the point-to-point messages and bytes the step sent."""

    schedule: str
    stages: int
    m: int
    loss: float
    reference_loss: float
    max_grad_diff: float
    equal: bool
    events: list
    bubble: float
    ideal: float
    peak_in_flight: list
    peak_activation_bytes: list
    messages: int
    message_bytes: int
    grads: list = field(default_factory=list, repr=False)


def pipeline_worker(rank: int, world_size: int, configs: list, width: int, blocks: int,
                    batch: int, seed: int = 0, delay_s: float = 0.0, repeats: int = 1) -> list:
    """One rank of :func:`run_pipeline`: for each ``(schedule, M)`` in ``configs``, one warm-up
    step and then ``repeats`` measured steps of this rank's stage; the step whose whole
    pipeline (first start to last end over all ranks) was shortest is kept, the same step on
    every rank (``repeats=0``: just one step, kept). Returns, per configuration, this
    stage's gradients, loss, timeline, peak activations and the point-to-point messages it
    sent (counted by ``dpcourse.collectives.record_collectives``).

    Shown in lesson 11, §3.
    """
    from .collectives import record_collectives

    torch.set_num_threads(1)
    module = split_stages(make_mlp(width, blocks, seed), world_size)[rank]
    x, y = sample_batch(batch, width, seed)
    results = []
    for name, m in configs:
        schedule = _schedule(name)(world_size, m, rank)
        xs, ys = micro_batches(x, m), micro_batches(y, m)
        shape = (batch // m, width)
        kept = []
        for attempt in range(1 + repeats):     # repeats=0: the one step is kept
            module.zero_grad(set_to_none=True)
            dist.barrier()
            with record_collectives() as calls:
                rec = run_stage(module, schedule, rank, world_size, inputs=xs, targets=ys,
                                shape=shape, loss_fn=mse_loss, delay_s=delay_s)
            if attempt or not repeats:
                kept.append((rec, calls))
        # Every rank must keep the same attempt, or the Gantt chart mixes steps: the pipeline's
        # span of an attempt is its earliest start to its latest end over all ranks (one
        # monotonic clock on one machine).
        starts = torch.tensor([r.events[0][2] for r, _ in kept], dtype=torch.float64)
        ends = torch.tensor([r.events[-1][3] for r, _ in kept], dtype=torch.float64)
        dist.all_reduce(starts, op=dist.ReduceOp.MIN)
        dist.all_reduce(ends, op=dist.ReduceOp.MAX)
        rec, calls = kept[int(torch.argmin(ends - starts))]
        results.append({
            "record": rec,
            "grads": [p.grad.clone() for p in module.parameters()],
            "messages": len(calls.of("send")),
            "message_bytes": sum(c.nbytes for c in calls.of("send")),
        })
    return results


def run_pipeline(stages: int = 2, micro: tuple = (1, 2, 4, 8), schedules=("gpipe",), *,
                 width: int = 64, blocks: int = 4, batch: int = 32, seed: int = 0,
                 delay_s: float = 0.0, repeats: int = 1, timeout: float = 60.0) -> list:
    """Run every schedule in ``schedules`` with every micro-batch count in ``micro`` on
    ``stages`` gloo ranks (one launch), and compare each with the unsplit model on the whole
    batch. Returns one :class:`PipelineRun` per (schedule, M), in that order.

    Shown in lesson 11, §3.
    """
    from . import launch

    if stages < 2:
        raise ValueError(f"a pipeline needs at least 2 stages, got {stages}")
    configs = [(name, m) for name in schedules for m in micro]
    for name, m in configs:
        _schedule(name)
        if batch % m:
            raise ValueError(f"a batch of {batch} cannot be cut into {m} equal micro-batches")
    outs = launch.spawn(pipeline_worker, stages, configs, width, blocks, batch, seed, delay_s,
                        repeats, backend="gloo", timeout=timeout)
    model = make_mlp(width, blocks, seed)
    x, y = sample_batch(batch, width, seed)
    ref_loss, ref_grads = reference_step(model, x, y, mse_loss)
    runs = []
    for j, (name, m) in enumerate(configs):
        per_rank = [outs[r][j] for r in range(stages)]
        grads = [g for r in per_rank for g in r["grads"]]
        diff = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads))
        loss = per_rank[-1]["record"].loss
        equal = (all(torch.allclose(a, b, rtol=RTOL, atol=ATOL)
                     for a, b in zip(grads, ref_grads))
                 and abs(loss - ref_loss) <= ATOL + RTOL * abs(ref_loss))
        t0 = min(ev[2] for r in per_rank for ev in r["record"].events)
        events = sorted(((r["record"].stage, kind, i, start - t0, end - t0)
                         for r in per_rank for kind, i, start, end in r["record"].events),
                        key=lambda e: (e[3], e[0]))
        runs.append(PipelineRun(
            schedule=name, stages=stages, m=m, loss=loss, reference_loss=ref_loss,
            max_grad_diff=diff, equal=equal, events=events, bubble=measured_bubble(events),
            ideal=ideal_bubble(stages, m),
            peak_in_flight=[r["record"].peak_in_flight for r in per_rank],
            peak_activation_bytes=[r["record"].peak_activation_bytes for r in per_rank],
            messages=sum(r["messages"] for r in per_rank),
            message_bytes=sum(r["message_bytes"] for r in per_rank), grads=grads))
    return runs


def torch_pipelining_worker(rank: int, world_size: int, schedule: str, m: int, width: int,
                            blocks: int, batch: int, seed: int = 0) -> dict:
    """One rank of torch's own pipeline: ``PipelineStage`` around this rank's stage and
    ``ScheduleGPipe`` or ``Schedule1F1B`` (torch.distributed.pipelining) on the same model,
    batch and loss as :func:`pipeline_worker` (torch makes the micro-batches' accumulated
    gradients the batch's itself, once the step's backwards are done: ``scale_grads=True`` by
    default, ``perform_reduce_grad`` calls ``scale_grads``, stage.py; its loss stays each
    micro-batch's mean). Two steps: the
    first also sets the stages up — a warm-up vote (one int32 each way per boundary,
    ``_warmup_forward_vote``) and the output metadata (``_send_meta``, ``send_object_list``),
    stage.py — so the messages of a step are counted on the second. Returns this stage's
    gradients and points-to-point sends of the second step, the setup's extra sends, and the
    last stage's per-micro-batch losses.

    Shown in lesson 11, §3.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from .collectives import record_collectives

    torch.set_num_threads(1)
    module = split_stages(make_mlp(width, blocks, seed), world_size)[rank]
    stage = PipelineStage(module, rank, world_size, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = cls(stage, n_microbatches=m, loss_fn=mse_loss)
    x, y = sample_batch(batch, width, seed)
    sends = []
    for _ in range(2):
        module.zero_grad(set_to_none=True)
        losses: list = []
        with record_collectives() as calls:
            if rank == 0:
                runner.step(x)
            elif rank == world_size - 1:
                runner.step(target=y, losses=losses)
            else:
                runner.step()
        sends.append(calls.of("send"))
    return {"grads": [p.grad.clone() for p in module.parameters()],
            "losses": [float(v.detach()) for v in losses],
            "messages": len(sends[1]),
            "message_bytes": sum(c.nbytes for c in sends[1]),
            "setup_messages": len(sends[0]) - len(sends[1])}


def compare_with_torch_pipelining(stages: int = 2, m: int = 4, schedule: str = "gpipe", *,
                                  width: int = 64, blocks: int = 4, batch: int = 32,
                                  seed: int = 0, timeout: float = 60.0) -> dict:
    """Our pipeline and torch's (``torch.distributed.pipelining``) on the same model, batch
    and schedule: the largest gradient difference between them, each one's difference from
    the unsplit model, both losses, both step's messages and bytes (point-to-point sends, all
    ranks), and the sends torch's first step adds to set its stages up.

    Shown in lesson 11, §3.
    """
    from . import launch

    ours = run_pipeline(stages, (m,), (schedule,), width=width, blocks=blocks, batch=batch,
                        seed=seed, timeout=timeout)[0]
    theirs = launch.spawn(torch_pipelining_worker, stages, schedule, m, width, blocks, batch,
                          seed, backend="gloo", timeout=timeout)
    model = make_mlp(width, blocks, seed)
    x, y = sample_batch(batch, width, seed)
    ref_loss, ref_grads = reference_step(model, x, y, mse_loss)
    their_grads = [g for r in theirs for g in r["grads"]]
    their_loss = sum(theirs[-1]["losses"]) / m
    return {
        "torch_vs_reference": max((a - b).abs().max().item()
                                  for a, b in zip(their_grads, ref_grads)),
        "ours_vs_reference": ours.max_grad_diff,
        "torch_vs_ours": max((a - b).abs().max().item() for a, b in zip(their_grads, ours.grads)),
        "torch_loss": their_loss,
        "our_loss": ours.loss,
        "reference_loss": ref_loss,
        "torch_messages": sum(r["messages"] for r in theirs),
        "torch_message_bytes": sum(r["message_bytes"] for r in theirs),
        "torch_setup_messages": sum(r["setup_messages"] for r in theirs),
        "our_messages": ours.messages,
        "our_message_bytes": ours.message_bytes,
    }
