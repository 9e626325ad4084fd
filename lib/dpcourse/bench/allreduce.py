"""``python -m dpcourse.bench allreduce``: lesson 06's ring against ``dist.all_reduce``.

    python -m dpcourse.bench allreduce                       # 1 KiB .. 64 MiB, 2 and 4 ranks
    python -m dpcourse.bench allreduce --sizes 1M 16M 64M --world-sizes 2 4 --reps 5
    python -m dpcourse.bench allreduce --json                # one JSON document on stdout

It times :func:`dpcourse.ring.ring_allreduce` and the built-in ``dist.all_reduce`` on float32
tensors, over gloo on CPU (or nccl when every rank owns a GPU), in processes started by
:func:`dpcourse.launch.spawn`. For each size and world size it prints the time of one
all-reduce and its bandwidth in nccl-tests' terms:

* algbw = bytes / time (the size of the tensor over the time to all-reduce it);
* busbw = algbw * 2(n-1)/n — what each link must carry for an optimal all-reduce (the ring's
  2(n-1)K/n bytes per rank), so busbw is comparable across world sizes and with the link's
  own bandwidth;

and the ratio ring busbw / all_reduce busbw. Lesson 06 uses :func:`measure_allreduce` for its
(much shorter) alpha-beta measurement.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "DEFAULT_SIZES",
    "parse_size",
    "format_size",
    "bus_bandwidth",
    "reps_for",
    "measure_allreduce",
    "AllreduceRow",
    "run_allreduce_bench",
    "format_table",
    "summarize_allreduce",
    "compare",
    "quartiles",
]

KiB, MiB = 1024, 1024 * 1024
DEFAULT_SIZES = tuple(KiB * 4 ** i for i in range(9))  # 1 KiB, 4 KiB, ..., 64 MiB
IMPLS = ("ring", "all_reduce")


def parse_size(text: str | int) -> int:
    """``"64M"``, ``"64MiB"``, ``"16k"``, ``"4096"`` -> bytes (binary units)."""
    if isinstance(text, int):
        nbytes = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*", str(text))
        if not m:
            raise ValueError(f"cannot read size {text!r}: write e.g. 1024, 4K, 16M or 1G")
        nbytes = int(m[1]) * {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB}[m[2].lower()]
    if nbytes < 4 or nbytes % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return nbytes


def format_size(nbytes: int) -> str:
    for unit, div in (("GiB", 1024 * MiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce, bytes/s: algbw * 2(n-1)/n.

    Shown in lesson 06, §4."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size


def reps_for(nbytes: int, reps: int, max_reps: int = 50) -> int:
    """How many timed repetitions a size gets: at least ``reps``, more for small sizes (up to
    ``max_reps``, about 16 MiB moved in all), whose times are short and noisy. Every rank
    computes the same number from the size alone — ranks that disagreed would hang.

    Shown in lesson 06, §4."""
    return max(reps, min(max_reps, (16 * MiB) // max(nbytes, 1)))


def measure_allreduce(rank: int, world_size: int, sizes: Sequence[int], reps: int = 5,
                      warmup: int = 1, impls: Sequence[str] = IMPLS,
                      max_reps: int = 50) -> dict:
    """Worker (run it with ``launch.spawn(measure_allreduce, n, sizes, backend="gloo")``):
    seconds per all-reduce, ``{impl: {nbytes: [one time per rep]}}``, as this rank saw them.

    Each timed call starts after a barrier, so a rank's time includes waiting for the slowest
    peer; the caller takes the maximum over ranks, rep by rep. The implementations take turns
    rep by rep, so a burst of load from elsewhere on the machine hits both alike. Small sizes
    get more reps (:func:`reps_for`). One torch thread per rank: the ranks share the cores,
    and gloo's own reduction is single-threaded too, so both get the same compute.

    Shown in lesson 06, §3.
    """
    import torch
    import torch.distributed as dist

    from dpcourse.ring import ring_allreduce

    torch.set_num_threads(1)
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    funcs = {"ring": ring_allreduce, "all_reduce": dist.all_reduce}
    out: dict = {impl: {} for impl in impls}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        n_reps = reps_for(nbytes, reps, max_reps)
        times: dict = {impl: [] for impl in impls}
        for i in range(warmup + n_reps):
            order = impls if i % 2 == 0 else list(reversed(impls))
            for impl in order:
                dist.barrier()
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                funcs[impl](x)
                if device != "cpu":
                    torch.cuda.synchronize()
                t = time.perf_counter() - t0
                x.fill_(1.0)  # keep the values bounded (and never inf) rep after rep
                if i >= warmup:
                    times[impl].append(t)
        for impl in impls:
            out[impl][nbytes] = times[impl]
    return out


@dataclass
class AllreduceRow:
    """One size and world size: median seconds and bus bandwidth (bytes/s) of both.

    Shown in lesson 06, §4."""

    world_size: int
    nbytes: int
    ring_s: float
    all_reduce_s: float
    ring_busbw: float
    all_reduce_busbw: float
    # The ratio rep by rep (the two took turns, so each rep's pair saw the same machine):
    # its median, quartiles (q1, q3) and (min, max); and each side's fastest rep. None when
    # built by hand without per-rep times.
    ratio_median: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None
    ratio_q1: float | None = None
    ratio_q3: float | None = None
    ring_min_s: float | None = None
    all_reduce_min_s: float | None = None
    ratios: list | None = None

    @property
    def ratio(self) -> float:
        """ring busbw / all_reduce busbw of the medians (1.0 = as fast as the built-in)."""
        return self.ring_busbw / self.all_reduce_busbw


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(q1, q3) of ``values`` (inclusive method: with 3 values, q1 is halfway between the 1st
    and 2nd of them sorted, q3 halfway between the 2nd and 3rd).

    Shown in lesson 06, §4."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def summarize_allreduce(per_rank: Sequence[dict], world_size: int,
                        sizes: Sequence[int]) -> list[AllreduceRow]:
    """Rows from :func:`measure_allreduce`'s per-rank results: each rep's time is the slowest
    rank's; medians and fastest reps of both, and the ring÷built-in busbw ratio pair by pair
    (a pair = the two calls of one rep, which took turns and saw the same machine).

    Shown in lesson 06, §3."""
    rows = []
    for nbytes in sizes:
        med, slowest = {}, {}
        for impl in IMPLS:
            count = len(per_rank[0][impl][nbytes])
            slowest[impl] = [max(r[impl][nbytes][i] for r in per_rank) for i in range(count)]
            med[impl] = statistics.median(slowest[impl])
        # busbw ring / busbw built-in of one rep = built-in time / ring time
        ratios = [b / a for a, b in zip(slowest["ring"], slowest["all_reduce"])]
        q1, q3 = quartiles(ratios)
        rows.append(AllreduceRow(world_size, nbytes, med["ring"], med["all_reduce"],
                                 bus_bandwidth(nbytes, med["ring"], world_size),
                                 bus_bandwidth(nbytes, med["all_reduce"], world_size),
                                 statistics.median(ratios), min(ratios), max(ratios), q1, q3,
                                 min(slowest["ring"]), min(slowest["all_reduce"]), ratios))
    return rows


def compare(rows: Sequence[AllreduceRow]) -> str:
    """One honest phrase for the ring against the built-in over ``rows``, from their per-pair
    ratios pooled: "the ring was faster" only when three quarters of the pairs say so (q1 > 1),
    "the built-in was faster" when q3 < 1, otherwise "no clear difference"; with the median
    ratio and its quartiles."""
    pooled = [r for row in rows for r in (row.ratios or [])]
    if not pooled:
        raise ValueError("compare needs rows with per-rep ratios (from summarize_allreduce)")
    q1, q3 = quartiles(pooled)
    med = statistics.median(pooled)
    if q1 > 1:
        verdict = "the ring was faster"
    elif q3 < 1:
        verdict = "the built-in was faster"
    else:
        verdict = "no clear difference"
    return f"{verdict} (ring÷built-in busbw per pair: median {med:.2f}, quartiles {q1:.2f}-{q3:.2f})"


def run_allreduce_bench(sizes: Sequence[int] = DEFAULT_SIZES, world_sizes: Sequence[int] = (2, 4),
                        reps: int = 5, warmup: int = 1, backend: str = "gloo",
                        timeout: float = 600.0) -> list[AllreduceRow]:
    """Launch the measurement for each world size and summarise it (median over reps of the
    slowest rank's time)."""
    from dpcourse import launch

    sizes = [parse_size(s) for s in sizes]
    for n in world_sizes:
        if not isinstance(n, int) or n < 2:
            raise ValueError(f"world sizes must be ints >= 2, got {n!r}")
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps!r}")
    from dpcourse import ddp

    for n in world_sizes:   # nccl needs a GPU per rank: say so before any rank starts
        ddp.validate_world_size(n, backend)
    rows = []
    for n in world_sizes:
        per_rank = launch.spawn(measure_allreduce, n, sizes, reps, warmup, backend=backend,
                                timeout=timeout, show_output=False)
        rows += summarize_allreduce(per_rank, n, sizes)
    return rows


_BUSBW_UNITS = {"GB/s": (1e9, 3), "MB/s": (1e6, 1)}   # unit: (bytes/s per unit, decimals)


def format_table(rows: Sequence[AllreduceRow], busbw_unit: str = "GB/s") -> str:
    """The table; the per-pair column is printed only when every row has per-rep ratios (rows
    from :func:`summarize_allreduce`), so it is never announced and left blank. ``busbw_unit``
    is "GB/s" or "MB/s" (MB/s keeps small messages' bus bandwidth from printing as 0.000).

    Shown in lesson 06, §4."""
    if busbw_unit not in _BUSBW_UNITS:
        raise ValueError(f"busbw_unit must be one of {sorted(_BUSBW_UNITS)}, got {busbw_unit!r}")
    scale, decimals = _BUSBW_UNITS[busbw_unit]
    per_pair = all(r.ratio_median is not None for r in rows)
    bw_head = f"busbw {busbw_unit}"
    head = (f"{'ranks':>5} {'size':>9} | {'ring ms':>9} {bw_head:>10} | "
            f"{'all_reduce ms':>13} {bw_head:>10} | {'busbw ring÷built-in':>19}"
            + (f" {'per pair: median [q1-q3] (min-max)':>36}" if per_pair else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r.world_size:>5} {format_size(r.nbytes):>9} | {r.ring_s * 1e3:>9.3f} "
                f"{r.ring_busbw / scale:>10.{decimals}f} | {r.all_reduce_s * 1e3:>13.3f} "
                f"{r.all_reduce_busbw / scale:>10.{decimals}f} | {r.ratio:>19.2f}")
        if per_pair:
            q1 = r.ratio_q1 if r.ratio_q1 is not None else r.ratio_min
            q3 = r.ratio_q3 if r.ratio_q3 is not None else r.ratio_max
            cell = (f"{r.ratio_median:.2f} [{q1:.2f}-{q3:.2f}] "
                    f"({r.ratio_min:.2f}-{r.ratio_max:.2f})")
            line += f" {cell:>36}"
        lines.append(line)
    note = ("(busbw ring÷built-in: the ring's bus bandwidth as a fraction of dist.all_reduce's, "
            "from the medians; higher is better, 1.00 = as fast")
    if per_pair:
        note += ("; per pair: the same ratio for each rep's interleaved pair, its median, "
                 "quartiles and range")
    lines.append(note + ")")
    return "\n".join(lines)
