"""Lesson 03 (DDP from first principles): the four collectives, what each rank holds before
and after ("The four collectives"), DDP's buckets on a timeline of the backward (recorded by
the lesson's ``bucket_worker``), and DistributedSampler's order per epoch and rank
("DistributedSampler and set_epoch").
"""

from __future__ import annotations

from .common import new_figure

__all__ = ["collectives_figure", "bucket_timelines_figure", "sampler_grid_figure"]


def collectives_figure(before: dict, after: dict):
    """One panel per collective: what each rank holds before (left) and after (right).
    ``before[name][r]`` and ``after[name][r]`` are printable values of rank r."""
    names = list(after)
    n_ranks = len(next(iter(after.values())))
    fig = new_figure(2.6 * len(names), 0.75 * n_ranks + 1.3)
    for k, name in enumerate(names):
        ax = fig.add_axes([k / len(names) + 0.005, 0.02, 1 / len(names) - 0.01, 0.82])
        ax.set_xlim(-1.6, 3.0)
        ax.set_ylim(-n_ranks + 0.4, 0.9)
        ax.axis("off")
        ax.set_title(name, fontsize=9.5)
        ax.text(0.2, 0.55, "before", ha="center", fontsize=7.5, color="#555555")
        ax.text(2.2, 0.55, "after", ha="center", fontsize=7.5, color="#555555")
        for r in range(n_ranks):
            ax.text(-1.55, -r, f"rank {r}", va="center", fontsize=7.5)
            _value_box(ax, 0.2, -r, _fmt(before[name][r]), "#fce5cd")
            _value_box(ax, 2.2, -r, _fmt(after[name][r]), "#d9ead3")
            ax.annotate("", (1.42, -r), (0.98, -r), arrowprops=dict(arrowstyle="-|>", lw=0.8))
    fig.suptitle("The four collectives: every rank calls them and every rank gets a result "
                 "(reduce_scatter gives each its own piece)", fontsize=10)
    return fig


def _value_box(ax, x, y, text, colour, w=1.5, h=0.6):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02",
                                fc=colour, ec="#444444", lw=0.7))
    ax.text(x, y, text, ha="center", va="center", fontsize=7.5)


def _fmt(value) -> str:
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return "\n".join(_fmt(v) for v in value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    return f"{value:g}"


def sampler_grid_figure(orders: dict):
    """DistributedSampler's index order per epoch and rank, one panel per setting.

    ``orders[label][epoch][rank]`` is the list of indices that rank reads in that epoch. Each
    cell shows an index, coloured by its value, so an order that repeats shows as a repeated
    pattern of colours."""
    labels = list(orders)
    epochs = len(orders[labels[0]])
    ranks = len(orders[labels[0]][0])
    per = len(orders[labels[0]][0][0])
    n_max = max(max(max(o) for o in per_rank) for v in orders.values() for per_rank in v) + 1
    fig = new_figure(4.2 * len(labels), 0.42 * epochs * ranks + 1.2)
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    for k, label in enumerate(labels):
        ax = fig.add_subplot(1, len(labels), k + 1)
        row = 0
        ticks = []
        for e in range(epochs):
            for r in range(ranks):
                for j, idx in enumerate(orders[label][e][r]):
                    ax.add_patch(matplotlib.patches.Rectangle((j, -row - 1), 1, 1,
                                                              fc=cmap(idx % 20), ec="white"))
                    ax.text(j + 0.5, -row - 0.5, str(idx), ha="center", va="center",
                            fontsize=7)
                ticks.append((-row - 0.5, f"epoch {e}, rank {r}"))
                row += 1
            row += 0.3
        ax.set_xlim(0, per)
        ax.set_ylim(-row, 0)
        ax.set_yticks([t for t, _ in ticks])
        ax.set_yticklabels([s for _, s in ticks], fontsize=7)
        ax.set_xticks([])
        ax.set_title(label, fontsize=9.5)
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
    fig.subplots_adjust(left=0.13, right=0.98, bottom=0.04, top=0.88, wspace=0.45)
    fig.suptitle(f"{n_max} samples over {ranks} ranks: which indices each rank reads, in order",
                 fontsize=10)
    return fig


def bucket_timelines_figure(iterations: dict):
    """Backward passes under DDP on one rank, one panel per iteration, on a shared time axis.

    ``iterations`` maps a panel title to the record of one backward, as lesson 03's
    ``bucket_worker`` returns it: ``{"backward_end": ms, "grads": [(name, ms)], "buckets":
    [(names, bytes, start_ms, end_ms)]}``. Each panel has a row of ticks (one per gradient, when
    it was computed) and one bar per bucket, from the launch of its all-reduce to its end; the
    row's label gives the bucket's index and size, not its tensors (which gradients share a
    bucket is lab 07 part 1's question). The x axis ends where the slowest backward
    returned.
    """
    if not iterations:
        raise ValueError("bucket_timelines_figure needs at least one iteration")
    rows = [len(it["buckets"]) + 1 for it in iterations.values()]
    fig = new_figure(8.5, 0.9 + 0.42 * sum(rows) + 0.35 * len(rows))
    axes = fig.subplots(len(rows), 1, sharex=True, gridspec_kw={"height_ratios": rows})
    axes = list(axes) if len(rows) > 1 else [axes]
    end_all = max(it["backward_end"] for it in iterations.values())
    for ax, (title, it) in zip(axes, iterations.items()):
        buckets, n = it["buckets"], len(it["buckets"])
        for _, t in it["grads"]:
            ax.plot([t, t], [n - 0.3, n + 0.3], color="#444444", lw=1)
        last = max(t for _, t in it["grads"])
        ax.axvline(last, color="#d62728", ls="--", lw=1, label="last gradient computed")
        ax.axvline(it["backward_end"], color="black", lw=1.2, label="backward() returns")
        labels = []
        for i, (names, nbytes, start, stop) in enumerate(buckets):
            ax.barh(n - 1 - i, max(stop - start, end_all * 0.004), left=start, height=0.5,
                    color="#1f77b4")
            labels.append(f"bucket {i}")   # contents and sizes: lab 07 part 1 asks what closes one
        ax.set_yticks(range(n + 1))
        ax.set_yticklabels(labels[::-1] + ["gradients computed"], fontsize=7)
        ax.set_ylim(-0.6, n + 0.6)
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_title(title, fontsize=9)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=7, loc="upper right", ncol=2, frameon=False)
    axes[-1].set_xlim(0, end_all * 1.02)
    axes[-1].set_xlabel("ms since backward() was called")
    fig.subplots_adjust(left=0.31, right=0.97, top=0.88, bottom=0.12, hspace=0.6)
    return fig
