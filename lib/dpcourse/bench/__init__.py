"""Benchmarks of the course, as a command line tool: one module per benchmark.

    python -m dpcourse.bench allreduce                       # 1 KiB .. 64 MiB, 2 and 4 ranks
    python -m dpcourse.bench allreduce --sizes 1M 16M 64M --world-sizes 2 4 --reps 5
    python -m dpcourse.bench allreduce --json                # one JSON document on stdout
    python -m dpcourse.bench ddp                             # lesson 07: our DDPs vs torch's
    python -m dpcourse.bench ddp --caps 0.1 1 4 25 inf --steps 10 --json
    python -m dpcourse.bench scaling                         # single vs DataParallel vs DDP
    python -m dpcourse.bench scaling --tf --max-ranks 2      # + TF MirroredStrategy rows
    python -m dpcourse.bench single                          # fp32 vs TF32/AMP/channels_last

``allreduce`` (:mod:`dpcourse.bench.allreduce`, lesson 06): the hand-written ring against
``dist.all_reduce``, time and bus bandwidth per size and world size. ``ddp``
(:mod:`dpcourse.bench.ddp`, lesson 07): the hand-written DDPs against torch's, with a bucket-size
sweep. ``scaling`` (:mod:`dpcourse.bench.scaling`; ``--tf`` adds :mod:`dpcourse.bench.scaling_tf`):
one device, ``nn.DataParallel`` and DDP on 1..N devices beside the alpha-beta prediction.
``single`` (:mod:`dpcourse.bench.single`, lesson 01): the single-device loop tuned step by step.

Every bench here interleaves its variants (round-robin per rep, step or run, never all reps of
one then all of the next) and reports a median with its spread. The names lessons 06 and 07 use
(``bench.measure_allreduce``, ``bench.format_table`` ...) are re-exported here.
"""

from dpcourse.bench.allreduce import (DEFAULT_SIZES, AllreduceRow, bus_bandwidth, compare,
                                      format_size, format_table, measure_allreduce, parse_size,
                                      quartiles, reps_for, run_allreduce_bench,
                                      summarize_allreduce)
from dpcourse.bench.cli import main
from dpcourse.bench.ddp import format_ddp_table, run_ddp_bench

__all__ = ["DEFAULT_SIZES", "parse_size", "format_size", "bus_bandwidth", "reps_for",
           "measure_allreduce", "AllreduceRow", "run_allreduce_bench", "format_table",
           "summarize_allreduce", "compare", "quartiles", "run_ddp_bench", "format_ddp_table",
           "main"]
