"""Lesson 02 (`nn.DataParallel`, taken apart): who holds what in one DataParallel step (§4), and
the traffic through device 0 against a ring's rank ("Why it is slow"; also its explorer).
"""

from __future__ import annotations

from typing import Sequence

from .common import new_figure

__all__ = ["dp_step_figure", "traffic_both_ways_figure"]


def dp_step_figure(chunk_sizes: Sequence[int], n_params: int):
    """Who holds what in one step of lesson 02's copy-by-copy DataParallel (``dp.data_parallel``;
    the real class on NCCL broadcasts and reduces with collectives): one column per device, one row per move
    (scatter, replicate, parallel_apply, gather + loss, backward's reduce-add), arrows for what
    crosses between devices. ``chunk_sizes`` and ``n_params`` come from the run being drawn."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    n = len(chunk_sizes)
    batch = sum(chunk_sizes)
    rows = ["1. scatter X", "2. replicate W", "3. parallel_apply", "4. gather + loss",
            "5. backward: reduce-add"]
    fig = new_figure(1.9 * n + 2.4, 4.6)
    ax = fig.add_axes([0.0, 0.0, 1.0, 0.92])
    ax.set_xlim(-2.2, 1.9 * n)
    ax.set_ylim(-len(rows) - 0.1, 1.05)
    ax.axis("off")
    colours = {"data": "#cfe2f3", "weights": "#fce5cd", "compute": "#d9ead3", "dev0": "#f4cccc"}

    def box(col, row, text, colour):
        x, y = 1.9 * col, -row
        ax.add_patch(FancyBboxPatch((x + 0.1, y - 0.32), 1.6, 0.64, boxstyle="round,pad=0.02",
                                    fc=colour, ec="#444444", lw=0.8))
        ax.text(x + 0.9, y, text, ha="center", va="center", fontsize=8)

    def arrow(c0, r0, c1, r1, colour="#444444"):
        ax.add_patch(FancyArrowPatch((1.9 * c0 + 0.9, -r0 - 0.33), (1.9 * c1 + 0.9, -r1 + 0.33),
                                     arrowstyle="-|>", mutation_scale=9, color=colour, lw=0.9))

    for c in range(n):
        ax.text(1.9 * c + 0.9, 0.75, f"device {c}", ha="center", fontsize=9, weight="bold")
    for r, label in enumerate(rows):
        ax.text(-2.1, -r, label, ha="left", va="center", fontsize=8.5)
    for c, size in enumerate(chunk_sizes):
        box(c, 0, f"X[{sum(chunk_sizes[:c])}:{sum(chunk_sizes[:c + 1])}]\n{size} samples",
            colours["data"])
        box(c, 1, f"copy of W\n{n_params:,} numbers" if c else f"W (original)\n{n_params:,}",
            colours["weights"])
        box(c, 2, f"forward on\n{size} samples", colours["compute"])
        arrow(c, 2, 0, 3, "#1f77b4")  # outputs travel to device 0
        if c:  # weights leave device 0, over the top of the row
            ax.add_patch(FancyArrowPatch((0.9, -1 + 0.33), (1.9 * c + 0.9, -1 + 0.33),
                                         connectionstyle="arc3,rad=-0.18", arrowstyle="-|>",
                                         mutation_scale=9, color="#e69138", lw=0.9))
    box(0, 3, f"logits of all {batch}\nmean loss", colours["dev0"])
    box(0, 4, f"grad W = sum of\n{n} replicas' grads", colours["dev0"])
    for c in range(1, n):
        box(c, 4, f"grad of copy {c}\n-> device 0", colours["weights"])
        ax.add_patch(FancyArrowPatch((1.9 * c + 0.9, -4 - 0.33), (0.9, -4 - 0.33),
                                     connectionstyle="arc3,rad=-0.18", arrowstyle="-|>",
                                     mutation_scale=9, color="#cc0000", lw=0.9))
    fig.suptitle(f"One step of dp.data_parallel (copies one by one) on {n} devices, batch "
                 f"{batch}: everything passes through device 0", fontsize=10)
    return fig


def traffic_both_ways_figure(n_params: int, counted: dict[int, int],
                             ns: Sequence[int] = range(2, 17)):
    """Numbers sent plus received per step: device 0 of a copy-by-copy parameter server
    (lesson 02's DataParallel), 2(N−1)K, against one rank of a ring all-reduce, which sends
    2(N−1)K/N and receives as much, 4(N−1)K/N. ``counted`` maps N to the lesson's counted total
    for device 0 (drawn as points)."""
    ns = list(ns)
    k = n_params
    fig = new_figure(6.4, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(ns, [2 * (n - 1) * k for n in ns], "-", color="#cc0000",
            label="copy-by-copy parameter server: device 0 sends+receives 2(N−1)K")
    ax.plot(ns, [4 * (n - 1) * k / n for n in ns], "-", color="#2ca02c",
            label="ring all-reduce: one rank sends+receives 4(N−1)K/N")
    if counted:
        ax.plot(list(counted), list(counted.values()), "o", color="#cc0000",
                label="counted copies in this run (device 0)")
    ax.axhline(4 * k, color="#2ca02c", ls=":", lw=0.8)
    ax.text(ns[-1], 4 * k, "  4K", va="center", fontsize=8, color="#2ca02c")
    ax.set_xlabel("devices N")
    ax.set_ylabel("numbers sent + received per step")
    ax.set_title(f"K = {k:,} parameters", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.15, right=0.92, bottom=0.13, top=0.92)
    return fig
