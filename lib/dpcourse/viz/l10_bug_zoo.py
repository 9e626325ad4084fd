"""Lesson 10 (the bug zoo): what a rank does when its partner never joins a collective, the
ranks' collective calls side by side (where they disagree), the replicas' weights drifting
apart, and a NaN spreading through the all-reduce — in the lesson's order.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .common import new_figure

__all__ = ["timeout_behaviour_figure", "collective_trace_figure", "collective_traces_figure",
           "replica_checksums_figure", "nan_spread_figure"]


def timeout_behaviour_figure(timeout: float = 2.0):
    """What a rank does when its partner never joins a collective, per backend, as torch 2.14's
    source describes it (a diagram, not a measurement): gloo blocks in the call and raises at
    the timeout; NCCL, once the group's communicator exists, enqueues the collective and returns
    at once, Python runs on until it needs the result, and the watchdog thread tears the whole
    process down at the timeout (``ErrorHandlingMode``, ``ProcessGroupNCCL.hpp``); when the call
    is the group's first NCCL collective (communicator formed lazily, in blocking mode by
    default) the rank blocks inside the call while the communicator is set up, with no work
    queued for the watchdog to time out; with ``TORCH_NCCL_BLOCKING_WAIT=1`` NCCL's ``wait()``
    blocks and raises instead."""
    fig = new_figure(8.0, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    end = timeout * 1.6
    rows = [("gloo", [(0, timeout, "#d62728", "in all_reduce (blocked)")],
             "raises 'Timed out' in the call"),
            ("NCCL,\ncommunicator formed", [(0, 0.06 * end, "#1f77b4",
                                              "in all_reduce: enqueues the work, returns"),
                                             (0.06 * end, timeout * 0.6, "#9edae5",
                                              "Python runs on\n(call returned)"),
                                             (timeout * 0.6, timeout, "#ff7f0e",
                                              "blocks at\n.item()")],
             "the watchdog tears the\nprocess down"),
            ("NCCL, first collective", [(0, end, "#d62728",
                                         "in all_reduce: forming the communicator (blocked)")],
             "still blocked: no work\nqueued, no watchdog timeout"),
            ("NCCL + BLOCKING_WAIT", [(0, timeout, "#d62728", "in wait() (blocked)")],
             "wait() raises"), ]
    for y, (name, spans, outcome) in enumerate(reversed(rows)):
        for a, b, colour, label in spans:
            ax.barh(y, b - a, left=a, height=0.5, color=colour, edgecolor="black", lw=0.5)
            if label and b - a < 0.1 * end:   # too narrow to hold its label: put it above
                ax.text(a + 0.01 * end, y + 0.28, label, ha="left", va="bottom", fontsize=7)
            elif label:
                ax.text((a + b) / 2, y, label, ha="center", va="center", fontsize=7)
        if spans[-1][1] > timeout:   # still blocked at the timeout: nothing happens there
            ax.annotate("", xy=(end * 1.12, y), xytext=(end, y),   # open end: it goes on
                        arrowprops=dict(arrowstyle="-|>", color=spans[-1][2], lw=2))
            ax.text(end * 1.14, y, outcome, va="center", fontsize=7)
            continue
        ax.plot([timeout], [y], "X", color="black", ms=9)
        ax.text(timeout + 0.03 * end, y, outcome, va="center", fontsize=7)
    ax.axvline(timeout, color="grey", ls=":", lw=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in reversed(rows)], fontsize=8)
    ax.set_xlim(0, end * 1.55)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xticks([0, timeout])
    ax.set_xticklabels(["collective called", "timeout"], fontsize=8)
    ax.set_title("A diagram from torch's source, not a measurement: rank 0 calls all_reduce; "
                 "its partner never does", fontsize=9)
    fig.subplots_adjust(left=0.2, right=0.98, bottom=0.1, top=0.92)
    return fig


_OP_COLOURS = {"all_reduce": "#1f77b4", "broadcast": "#ff7f0e", "barrier": "#7f7f7f",
               "all_gather": "#2ca02c", "reduce_scatter": "#9467bd"}


def collective_trace_figure(traces: dict, title: str = "", ax=None):
    """One row per rank, one box per collective it called, in order (``traces`` from
    ``detectors.read_traces``). A box with a thick red edge is a call the rank never returned
    from; the first call where the ranks disagree is shaded."""
    from matplotlib.patches import FancyBboxPatch

    from dpcourse.detectors import compare_traces

    own = ax is None
    if own:
        fig = new_figure(6.0, 0.7 + 0.6 * len(traces))
        ax = fig.add_subplot(1, 1, 1)
    report = compare_traces(traces)
    longest = max((len(t) for t in traces.values()), default=0)
    if report.index is not None:
        ax.axvspan(report.index - 0.5, report.index + 0.5, color="#ffdddd", zorder=0)
    for r, calls in traces.items():
        for c in calls:
            colour = _OP_COLOURS.get(c["op"], "#8c564b")
            ax.add_patch(FancyBboxPatch(
                (c["i"] - 0.42, r - 0.3), 0.84, 0.6, boxstyle="round,pad=0.02",
                facecolor=colour, alpha=0.85, edgecolor="#d62728" if not c["done"] else "white",
                linewidth=3 if not c["done"] else 1))
            ax.text(c["i"], r, c["op"].replace("_", "\n", 1), ha="center", va="center",
                    fontsize=7, color="white")
        if not calls or calls[-1]["done"]:
            ax.text(len(calls) - 0.4, r, "returned", va="center", fontsize=7, color="#444444")
    ax.set_xlim(-0.6, max(longest, 1) + 0.6)
    ax.set_ylim(len(traces) - 0.4, -0.6)
    ax.set_yticks(list(traces))
    ax.set_yticklabels([f"rank {r}" for r in traces])
    ax.set_xticks(range(max(longest, 1)))
    ax.set_xlabel("collective call #")
    ax.set_title(title, fontsize=9)
    if own:
        fig.subplots_adjust(left=0.14, right=0.97, bottom=0.3 if len(traces) < 3 else 0.2,
                            top=0.85)
        return fig
    return ax


def collective_traces_figure(panels: dict):
    """:func:`collective_trace_figure` for several programs, one panel each
    (``panels[title] = traces``)."""
    n = len(panels)
    fig = new_figure(6.5, 1.25 * n + 0.4)
    for k, (title, traces) in enumerate(panels.items()):
        collective_trace_figure(traces, title, ax=fig.add_subplot(n, 1, k + 1))
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.1, top=0.94, hspace=1.0)
    return fig


def replica_checksums_figure(panels: dict):
    """``panels[title][variant]`` = per-rank lists of one number per step (a weight checksum),
    entry 0 the starting weights and entry k the weights after k steps (the x-axis says so).
    Broken runs drawn solid, fixed runs dashed; ranks that agree draw one line."""
    fig = new_figure(9.0, 3.3)
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for k, (title, variants) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for variant, per_rank in variants.items():
            style = "-" if variant == "broken" else "--"
            for r, values in enumerate(per_rank):
                ax.plot(range(len(values)), values, style, marker="o", ms=3,
                        color=colours[r % 4] if variant == "broken" else "#555555",
                        lw=1.5 if variant == "broken" else 2.5, alpha=0.9,
                        label=f"rank {r} ({variant})")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("steps taken (0: the starting weights)")
        ax.set_ylabel("weight checksum")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.15, top=0.9, wspace=0.3)
    return fig


def nan_spread_figure(local: Sequence[Sequence[float]], evaluated: dict, bad: tuple | None,
                      what: str = "local gradient norm"):
    """Left: each rank's local value per step (``what``; a cross where it is NaN); right: the
    loss of the
    model after each step, broken and fixed (``evaluated[variant]`` per step). ``bad``: the
    (step, ranks) where the first NaN appeared. Steps are counted from 0 (0: the first step),
    and the x-axes say so."""
    fig = new_figure(9.0, 3.3)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    finite_max = max((v for vals in local for v in vals if math.isfinite(v)), default=1.0)
    for r, vals in enumerate(local):
        steps = range(len(vals))
        ax.plot(steps, [v if math.isfinite(v) else np.nan for v in vals], "-o", ms=3,
                color=colours[r % 4], label=f"rank {r}")
        nan_steps = [s for s in steps if not math.isfinite(vals[s])]
        # one row of marks per rank, so no rank's marks hide another's
        ax.plot(nan_steps, [finite_max * (1.1 + 0.12 * r)] * len(nan_steps), "x", ms=8, mew=2,
                color=colours[r % 4])
    if bad is not None:
        ax.axvline(bad[0], color="#d62728", ls=":", lw=1)
        ax.text(bad[0], finite_max * 0.5, f" first NaN:\n rank {bad[1][0]}", fontsize=8,
                color="#d62728")
    ax.set_title(f"{what} per rank, before all-reduce (x = NaN, one row per rank)",
                 fontsize=9)
    ax.set_xlabel("step index (0: the first step)")
    ax.legend(fontsize=7)
    for variant, vals in evaluated.items():
        steps = range(len(vals))
        bx.plot(steps, [v if math.isfinite(v) else np.nan for v in vals],
                "-o" if variant == "broken" else "--s", ms=3, label=variant)
        nan_steps = [s for s in steps if not math.isfinite(vals[s])]
        bx.plot(nan_steps, [0.04] * len(nan_steps), "x", ms=8, mew=2, color="#d62728",
                transform=bx.get_xaxis_transform())  # along the bottom edge
    bx.set_title("held-out loss after each step (x = NaN)", fontsize=9)
    bx.set_xlabel("step index (0: after the first step)")
    bx.legend(fontsize=7)
    for a in (ax, bx):
        a.grid(True, alpha=0.3)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.15, top=0.9, wspace=0.25)
    return fig
