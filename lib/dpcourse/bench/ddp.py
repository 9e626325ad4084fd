"""``python -m dpcourse.bench ddp``: lesson 07's hand-written DDPs against torch's, buckets swept.

    python -m dpcourse.bench ddp                             # our DDPs vs torch's
    python -m dpcourse.bench ddp --caps 0.1 1 4 25 inf --steps 10 --json

It times one training step of a model of many equal Linear layers
(``overlap_experiments.wide_mlp``, 28 MiB at the defaults) synchronised four ways — all-reduce
after the backward, one async all-reduce per parameter from hooks, the course's bucketed
wrapper, and torch's DistributedDataParallel — and the bucketed wrapper at each cap of a
sweep, all in one run with their steps interleaved, repeated over ``--repeats`` launches
(default 3). It prints a table (step ms: median over launches of each launch's median, with
(min-max) over launches; all-reduces per step) and the ratio bucketed / DDP at the same cap
with its per-launch spread.
"""

from __future__ import annotations

import statistics
from typing import Sequence

__all__ = ["run_ddp_bench", "format_ddp_table"]


def run_ddp_bench(world_size: int = 2, caps: Sequence[float] = (0.1, 1, 4, 25, float("inf")),
                  cap: float = 25.0, steps: int = 7, width: int = 320, depth: int = 64,
                  global_batch: int = 64, backend: str = "gloo", timeout: float = 600.0,
                  repeats: int = 3) -> dict:
    """Run :func:`dpcourse.overlap_experiments.timing_worker` on ``world_size`` ranks: the four
    ways at ``cap`` MiB, then the bucketed wrapper at every cap in ``caps``, ``repeats`` launches
    (each interleaves the ways step by step). Returns rank 0's last result with each way's
    ``step_s`` the median over launches of its per-launch median, ``spread`` (min, max) over
    launches, and ``ratio`` = bucketed / DDP at ``cap`` (median of the per-launch ratios,
    ``ratio_spread``)."""
    from dpcourse import ddp, launch
    from dpcourse import overlap_experiments as experiments

    ddp.validate_world_size(world_size, backend)
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    cfg = experiments.OverlapConfig(model="wide_mlp", width=width, depth=depth,
                                    global_batch=global_batch, steps=steps)
    cfg.build()  # a clear error for a bad model size, before any rank starts
    runs = [(kind, cap) for kind in experiments.KINDS]
    runs += [("bucketed", c) for c in caps if c != cap]
    reps: dict = {run: [] for run in runs}
    ratios = []
    for _ in range(repeats):
        out = launch.spawn(experiments.timing_worker, world_size, cfg, runs, 2, backend=backend,
                           timeout=timeout, show_output=False)[0]
        by = {(r["kind"], r["bucket_cap_mb"]): r["step_s"] for r in out["runs"]}
        for run in runs:
            reps[run].append(by[run])
        ratios.append(by[("bucketed", cap)] / by[("ddp", cap)])
    for r in out["runs"]:
        vals = reps[(r["kind"], r["bucket_cap_mb"])]
        r.update(step_s=statistics.median(vals), spread=[min(vals), max(vals)])
    out.update(ratio=statistics.median(ratios), ratio_spread=[min(ratios), max(ratios)],
               repeats=repeats)
    out.update(world_size=world_size, backend=backend, cap=cap, width=width, depth=depth,
               global_batch=global_batch, steps=steps)
    return out


def format_ddp_table(result: dict) -> str:
    lines = [f"{'way':<16}{'bucket cap':>12}{'step (ms)':>11}{'(min-max)':>15}{'all-reduces':>13}"]
    for r in result["runs"]:
        cap = "one bucket" if r["bucket_cap_mb"] == float("inf") else f"{r['bucket_cap_mb']:g} MiB"
        if r["kind"] in ("after_backward", "per_parameter"):
            cap = "-"
        lo, hi = (1e3 * t for t in r.get("spread", (r["step_s"], r["step_s"])))
        lines.append(f"{r['kind']:<16}{cap:>12}{r['step_s'] * 1e3:>11.1f}"
                     f"{f'({lo:.1f}-{hi:.1f})':>15}{r['collectives_per_step']:>13}")
    lo, hi = result.get("ratio_spread", (result["ratio"], result["ratio"]))
    lines.append(f"bucketed / DDP at {result['cap']:g} MiB: {result['ratio']:.2f}x "
                 f"(per launch {lo:.2f}-{hi:.2f})")
    return "\n".join(lines)
