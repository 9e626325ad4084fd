"""Lesson 07 (inside DDP): what DDP's reducer does with one gradient, a bucketed step on a
timeline, the overlap model against the measurements, the bucket-size sweep, the ways of
synchronising side by side, and the comm hooks' losses and bytes — in the lesson's order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .common import new_figure

__all__ = ["reducer_figure", "overlap_timeline_figure", "overlap_model_figure",
           "bucket_sweep_figure", "step_time_bars_figure", "comm_hooks_figure"]


def reducer_figure():
    """Lesson 07: what DDP's reducer does with one gradient, left to right — the autograd hook,
    the gradient's values into its bucket, the launch in bucket order, the wait and the copy
    back (none with views). How the reducer keeps the order, and how it handles a gradient
    that may already be its view, are lab 07's part 2, so the figure draws neither."""
    from matplotlib.patches import FancyBboxPatch

    fig = new_figure(9.0, 2.4)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xlim(0, 10)
    ax.set_ylim(1.4, 3.7)
    ax.axis("off")
    steps = [
        ("1. hook", "autograd has accumulated\np.grad: the reducer's\nhook on p runs"),
        ("2. into the bucket",
         "p.grad's values end up\nin its slice of the\nbucket (÷N on the way)"),
        ("3. launch in order",
         "a complete bucket goes\non the wire in bucket\norder, never before one\nahead of it"),
        ("4. wait", "end of backward: wait on\nevery bucket's all-reduce"),
        ("5. copy back", "slice → p.grad;\nnothing to copy when\np.grad is the slice"),
    ]
    w, gap = 1.72, 0.3
    for k, (head, body) in enumerate(steps):
        x = 0.1 + k * (w + gap)
        ax.add_patch(FancyBboxPatch((x, 1.6), w, 1.9, boxstyle="round,pad=0.05",
                                    fc="#e8f0fa" if k != 2 else "#fde9d9", ec="#1f4e79"))
        ax.text(x + w / 2, 3.2, head, ha="center", va="center", fontsize=8.5, weight="bold")
        ax.text(x + w / 2, 2.35, body, ha="center", va="center", fontsize=7)
        if k:
            ax.annotate("", xy=(x - 0.02, 2.55), xytext=(x - gap + 0.02, 2.55),
                        arrowprops={"arrowstyle": "->", "lw": 1.2})
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=0.98)
    return fig


def overlap_timeline_figure(timeline: dict, title: str = ""):
    """One training step of a bucketed wrapper on one rank, from
    ``overlap_experiments.timing_worker``'s recorded timeline (ms since the backward began): a
    tick per gradient as it became ready, a bar per bucket from its all-reduce's launch to its
    end, the backward's end and the end of the synchronisation (wait + copy back + optimizer
    step)."""
    launches = {which: t for what, which, t in timeline["events"] if what == "launch"}
    dones = {which: t for what, which, t in timeline["events"] if what == "done"}
    order = sorted(launches, key=launches.get)
    n = len(order)
    fig = new_figure(8.5, 1.6 + 0.32 * (n + 1))
    ax = fig.add_subplot(1, 1, 1)
    end = timeline["backward_end"]
    ax.axvspan(0, end, color="#eeeeee", zorder=0, label="backward")
    for t in timeline["ready"]:
        ax.plot([t, t], [n - 0.35, n + 0.35], color="#444444", lw=0.8)
    for row, i in enumerate(order):
        y = n - 1 - row
        stop = dones.get(i, timeline["sync_end"])
        ax.barh(y, stop - launches[i], left=launches[i], height=0.6, color="#1f77b4")
    ax.axvline(end, color="#d62728", lw=1.2, ls="--", label="backward() returns")
    ax.axvline(timeline["sync_end"], color="#2ca02c", lw=1.2, ls=":",
               label="synchronised and stepped")
    ax.set_yticks([n] + ([n - 1, 0] if n > 1 else [0]))
    ax.set_yticklabels(["gradients ready"] + (["first bucket", f"bucket {n - 1}"] if n > 1
                                              else ["the bucket"]), fontsize=7.5)
    ax.set_xlabel("ms since backward() was called")
    ax.set_ylim(-0.8, n + 0.8)
    # outside the axes, so that it hides no bucket's bar
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9.5)
    fig.subplots_adjust(left=0.14, right=0.77, bottom=0.18, top=0.9)
    return fig


def overlap_model_figure(rows: Sequence[dict]):
    """Lesson 07: for each bucket cap, the step time the overlap model predicts (with overlap,
    and with every all-reduce after the backward) beside the measured ones."""
    fig = new_figure(7.6, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(rows))
    series = [("measured, overlapped", "measured_ms", "#1f77b4"),
              ("predicted, overlapped", "predicted_ms", "#9ecae1"),
              ("measured, launched after backward", "measured_after_ms", "#ff7f0e"),
              ("predicted, after backward", "predicted_after_ms", "#fdd0a2")]
    width = 0.2
    for k, (label, key, color) in enumerate(series):
        ax.bar(x + (k - 1.5) * width, [r[key] for r in rows], width, label=label, color=color)
    ax.set_xticks(x)
    ax.set_xticklabels([_cap_label(r["bucket_cap_mb"]) for r in rows], fontsize=8)
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("step time (ms)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(True, axis="y", alpha=0.3)
    fig.subplots_adjust(left=0.1, right=0.68, bottom=0.15, top=0.96)
    return fig


def _cap_label(cap) -> str:
    return "one bucket" if cap == float("inf") else f"{cap:g} MiB"


def bucket_sweep_figure(rows: Sequence[dict], noise_ms: float | None = None,
                        counts: bool = True):
    """Step time (ms) for each bucket cap, each bar labelled with its all-reduces per step
    (``counts=False``: unlabelled, for a page where the counts would answer a lab).

    Where a row has its rounds (``steps_s["step"]``, seconds), a black line spans their
    quartiles. ``noise_ms``, if given, is drawn as a grey band from the fastest median up by
    that much: the noise floor, the difference two runs of identical work show in a round.
    """
    fig = new_figure(7.0, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    labels = [_cap_label(r["bucket_cap_mb"]) for r in rows]
    ms = [r["step_s"] * 1e3 for r in rows]
    bars = ax.bar(range(len(rows)), ms, color="#1f77b4")
    top = list(ms)
    for i, r in enumerate(rows):
        rounds = sorted(t * 1e3 for t in r.get("steps_s", {}).get("step", []))
        if len(rounds) >= 4:
            q1, q3 = np.percentile(rounds, [25, 75])
            ax.plot([i, i], [q1, q3], color="black", lw=1.5)
            top[i] = max(top[i], q3)
    if noise_ms is not None:
        floor = min(ms)
        ax.axhspan(floor, floor + abs(noise_ms), color="#7f7f7f", alpha=0.3,
                   label=f"noise floor: identical work, {abs(noise_ms):.0f} ms apart in a typical round")
        ax.legend(loc="upper left", fontsize=7.5)
    for bar, r, y in zip(bars, rows, top):
        if counts:
            ax.text(bar.get_x() + bar.get_width() / 2, y,
                    f"{r['collectives_per_step']} all-reduces", ha="center", va="bottom",
                    fontsize=7.5)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("step time (ms, median)")
    ax.set_ylim(0, max(top + [min(ms) + abs(noise_ms or 0)]) * 1.25)
    ax.grid(True, axis="y", alpha=0.3)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.16, top=0.95)
    return fig


def step_time_bars_figure(names: Sequence[str], seconds: Sequence[float], title: str = "",
                          rounds: Sequence[Sequence[float]] | None = None):
    """Horizontal bars: one step time (ms) per way of synchronising the gradients; with
    ``rounds`` (each way's step time in every round, seconds), each round as a black dot on its
    bar, so that the run-to-run spread shows beside the medians."""
    fig = new_figure(7.0, 0.9 + 0.45 * len(names))
    ax = fig.add_subplot(1, 1, 1)
    ms = [s * 1e3 for s in seconds]
    ax.barh(range(len(names)), ms, color=["#7f7f7f", "#ff7f0e", "#1f77b4", "#2ca02c"][
        :len(names)] if len(names) <= 4 else "#1f77b4")
    top = max(ms)
    for i, runs in enumerate(rounds or []):
        xs = [s * 1e3 for s in runs]
        ax.plot(xs, np.full(len(xs), float(i)), "o", color="black", ms=3, alpha=0.6)
        top = max([top, *xs])
    for i, v in enumerate(ms):
        ax.text(v if not rounds else top, i, f" {v:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.25)
    ax.set_xlabel("step time (ms): bar the median" + (", dot one round" if rounds else ""))
    if title:
        ax.set_title(title, fontsize=9.5)
    ax.grid(True, axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.3, right=0.97, bottom=0.2, top=0.88)
    return fig


def comm_hooks_figure(runs: dict, bytes_per_step: dict, window: int = 10):
    """Left: each comm hook's loss curve (a moving mean over ``window`` steps). Right: the bytes
    each one all-reduced per step, on a log scale."""
    fig = new_figure(9.0, 3.4)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, losses in runs.items():
        x = np.asarray(losses, dtype=float)
        smooth = np.convolve(x, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(window - 1, len(x)), smooth, label=name, lw=1.3)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (mean of {window} steps)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    names = list(bytes_per_step)
    vals = [bytes_per_step[n] for n in names]
    bx.barh(range(len(names)), vals, color="#1f77b4")
    for i, v in enumerate(vals):
        bx.text(v, i, f" {v / 1024:.1f} KiB", va="center", fontsize=7.5)
    bx.set_xscale("log")
    bx.set_yticks(range(len(names)))
    bx.set_yticklabels(names, fontsize=8)
    bx.invert_yaxis()
    bx.set_xlim(min(vals) / 2, max(vals) * 8)
    bx.set_xlabel("bytes all-reduced per step (log)")
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.16, top=0.95, wspace=0.45)
    return fig
