"""The command line of ``python -m dpcourse.bench``: one subcommand per benchmark module.

``allreduce`` (:mod:`dpcourse.bench.allreduce`), ``ddp`` (:mod:`dpcourse.bench.ddp`), ``scaling``
(:mod:`dpcourse.bench.scaling`, with ``--tf`` :mod:`dpcourse.bench.scaling_tf`) and ``single``
(:mod:`dpcourse.bench.single`); each module owns its measurement, this file only parses and prints.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from dpcourse.bench import scaling, single
from dpcourse.bench.allreduce import (DEFAULT_SIZES, KiB, MiB, compare, format_size, format_table,
                                      parse_size, run_allreduce_bench)
from dpcourse.bench.ddp import format_ddp_table, run_ddp_bench

__all__ = ["main"]


def _bench_doc() -> str:
    import dpcourse.bench

    return dpcourse.bench.__doc__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.bench", description=_bench_doc(),
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
    d = sub.add_parser("ddp", help="all-reduce after backward, per-parameter hooks, buckets "
                                   "and DDP: step time, with a bucket-size sweep")
    d.add_argument("--world-size", type=int, default=2)
    d.add_argument("--caps", nargs="+", type=float, default=[0.1, 1, 4, 25, float("inf")],
                   help="bucket caps of the sweep, in MiB ('inf': one bucket)")
    d.add_argument("--cap", type=float, default=25.0,
                   help="the cap at which bucketed and DDP are compared (DDP's default: 25)")
    d.add_argument("--steps", type=int, default=7, help="timed steps per way (median)")
    d.add_argument("--width", type=int, default=320)
    d.add_argument("--depth", type=int, default=64)
    d.add_argument("--global-batch", type=int, default=64)
    d.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    d.add_argument("--timeout", type=float, default=600.0)
    d.add_argument("--repeats", type=int, default=3,
                   help="launches, each interleaving the ways step by step; median and (min-max)")
    d.add_argument("--json", action="store_true", help="print one JSON document instead")
    scaling.add_arguments(sub.add_parser(
        "scaling", help="single device vs DataParallel vs DDP on 1..N devices, with the "
                        "alpha-beta prediction and published results"))
    single.add_arguments(sub.add_parser(
        "single", help="one device: fp32 vs TF32, AMP bf16/fp16, channels_last, compile"))
    args = parser.parse_args(argv)
    if args.cmd in ("scaling", "single"):
        module = scaling if args.cmd == "scaling" else single
        try:
            return module.main(args)
        except ValueError as exc:
            parser.error(str(exc))
    if args.cmd == "ddp":
        try:
            result = run_ddp_bench(args.world_size, args.caps, args.cap, args.steps, args.width,
                                   args.depth, args.global_batch, args.backend, args.timeout,
                                   args.repeats)
        except ValueError as exc:
            parser.error(str(exc))
        if args.json:
            for r in result["runs"]:
                r.pop("timeline")
                if r["bucket_cap_mb"] == float("inf"):
                    r["bucket_cap_mb"] = "one bucket"   # JSON has no infinity
            print(json.dumps(result, indent=1, default=str))
        else:
            print(f"one training step of wide_mlp({args.width}, {args.depth}) "
                  f"({result['model_bytes'] / MiB:.1f} MiB) on {args.world_size} ranks over "
                  f"{args.backend}, median of {args.steps} steps, ways interleaved; median "
                  f"(min-max) over {args.repeats} launches")
            print(format_ddp_table(result))
        return 0
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
        for n in sorted({r.world_size for r in rows}):
            for label, pick in (("up to 64 KiB", lambda r: r.nbytes <= 64 * KiB),
                                ("16 MiB and up", lambda r: r.nbytes >= 16 * MiB)):
                group = [r for r in rows if r.world_size == n and pick(r)]
                if group:
                    print(f"{n} ranks, {label}: {compare(group)}")
    return 0
