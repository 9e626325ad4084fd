"""Benchmarks of the course, as a command line tool.

    python -m dpcourse.bench allreduce                       # 1 KiB .. 64 MiB, 2 and 4 ranks
    python -m dpcourse.bench allreduce --sizes 1M 16M 64M --world-sizes 2 4 --reps 5
    python -m dpcourse.bench allreduce --json                # one JSON document on stdout

``allreduce`` times the hand-written ring of lesson 06 (:func:`dpcourse.ring.ring_allreduce`)
and the built-in ``dist.all_reduce`` on float32 tensors, over gloo on CPU (or nccl when every
rank owns a GPU), in processes started by :func:`dpcourse.launch.spawn`. For each size and
world size it prints the time of one all-reduce and its bandwidth in nccl-tests' terms:

* algbw = bytes / time (the size of the tensor over the time to all-reduce it);
* busbw = algbw * 2(n-1)/n — what each link must carry for an optimal all-reduce (the ring's
  2(n-1)K/n bytes per rank), so busbw is comparable across world sizes and with the link's
  own bandwidth;

and the ratio ring busbw / all_reduce busbw. Lesson 06 uses :func:`measure_allreduce` for its
(much shorter) alpha-beta measurement. Other lessons may add subcommands here.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
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
    "main",
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
    """nccl-tests' bus bandwidth of an all-reduce, bytes/s: algbw * 2(n-1)/n."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size


def reps_for(nbytes: int, reps: int, max_reps: int = 50) -> int:
    """How many timed repetitions a size gets: at least ``reps``, more for small sizes (up to
    ``max_reps``, about 16 MiB moved in all), whose times are short and noisy. Every rank
    computes the same number from the size alone — ranks that disagreed would hang."""
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
    """One size and world size: median seconds and bus bandwidth (bytes/s) of both."""

    world_size: int
    nbytes: int
    ring_s: float
    all_reduce_s: float
    ring_busbw: float
    all_reduce_busbw: float

    @property
    def ratio(self) -> float:
        """ring busbw / all_reduce busbw (1.0 = as fast as the built-in)."""
        return self.ring_busbw / self.all_reduce_busbw


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
    rows = []
    for n in world_sizes:
        per_rank = launch.spawn(measure_allreduce, n, sizes, reps, warmup, backend=backend,
                                timeout=timeout, show_output=False)
        for nbytes in sizes:
            med = {}
            for impl in IMPLS:
                count = len(per_rank[0][impl][nbytes])
                slowest = [max(r[impl][nbytes][i] for r in per_rank) for i in range(count)]
                med[impl] = statistics.median(slowest)
            rows.append(AllreduceRow(n, nbytes, med["ring"], med["all_reduce"],
                                     bus_bandwidth(nbytes, med["ring"], n),
                                     bus_bandwidth(nbytes, med["all_reduce"], n)))
    return rows


def format_table(rows: Sequence[AllreduceRow]) -> str:
    head = (f"{'ranks':>5} {'size':>9} | {'ring ms':>9} {'busbw GB/s':>10} | "
            f"{'all_reduce ms':>13} {'busbw GB/s':>10} | {'busbw ring÷built-in':>19}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.world_size:>5} {format_size(r.nbytes):>9} | {r.ring_s * 1e3:>9.3f} "
                     f"{r.ring_busbw / 1e9:>10.3f} | {r.all_reduce_s * 1e3:>13.3f} "
                     f"{r.all_reduce_busbw / 1e9:>10.3f} | {r.ratio:>19.2f}")
    lines.append("(busbw ring÷built-in: the ring's bus bandwidth as a fraction of dist.all_reduce's; "
                 "higher is better, 1.00 = as fast)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("allreduce", help="hand-written ring vs dist.all_reduce: time and busbw")
    a.add_argument("--sizes", nargs="+", default=[format_size(s).replace(" ", "")
                                                  for s in DEFAULT_SIZES],
                   help="tensor sizes in bytes (1K, 4M, 64MiB ...); default 1 KiB .. 64 MiB")
    a.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    a.add_argument("--reps", type=int, default=5,
                   help="timed repetitions per size, at least (small sizes get up to 50); median")
    a.add_argument("--warmup", type=int, default=1)
    a.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    a.add_argument("--timeout", type=float, default=600.0, help="seconds per world size")
    a.add_argument("--json", action="store_true", help="print one JSON document instead")
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes]
        rows = run_allreduce_bench(sizes, args.world_sizes, args.reps, args.warmup,
                                   args.backend, args.timeout)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        doc = {"benchmark": "allreduce", "dtype": "float32", "backend": args.backend,
               "min_reps": args.reps, "busbw": "algbw * 2(n-1)/n (nccl-tests)",
               "rows": [dict(asdict(r), ratio=r.ratio) for r in rows]}
        print(json.dumps(doc, indent=1))
    else:
        print(f"all-reduce of float32 tensors over {args.backend}, median of >= {args.reps} reps "
              f"(slowest rank); busbw = algbw * 2(n-1)/n")
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
