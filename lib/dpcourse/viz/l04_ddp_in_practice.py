"""Lesson 04 (DDP in practice): a torchrun job killed and restarted from its last checkpoint,
against the uninterrupted run (§3, "Checkpoints and fault tolerance").
"""

from __future__ import annotations

from .common import new_figure

__all__ = ["restart_timeline_figure"]


def restart_timeline_figure(total_steps: int, ckpt_every: int, fail_at: int, resumed: int):
    """Two attempts of one torchrun job against the optimizer step: checkpoints saved, the
    kill, the restart from the last checkpoint, and the uninterrupted run for comparison.
    The numbers are the run's own (parsed from its output by the lesson)."""
    fig = new_figure(8, 2.8)
    ax = fig.add_subplot(1, 1, 1)
    rows = {"uninterrupted run": 2, "attempt 0": 1, "attempt 1 (restart)": 0}
    end = min(total_steps, fail_at + 5)
    ax.barh(rows["uninterrupted run"], end, left=0, height=0.35, color="#999999")
    ax.barh(rows["attempt 0"], fail_at, left=0, height=0.35, color="#1f77b4")
    ax.barh(rows["attempt 1 (restart)"], end - resumed, left=resumed, height=0.35,
            color="#2ca02c")
    saved = [s for s in range(ckpt_every, fail_at + 1, ckpt_every)]
    ax.plot(saved, [rows["attempt 0"]] * len(saved), "v", color="black", ms=8,
            label="checkpoint saved (rank 0)")
    ax.plot([fail_at], [rows["attempt 0"]], "X", color="#d62728", ms=11, label="rank 1 killed")
    ax.annotate("", (resumed, rows["attempt 1 (restart)"] + 0.2),
                (resumed, rows["attempt 0"] - 0.2),
                arrowprops=dict(arrowstyle="-|>", color="black", lw=1))
    ax.text(resumed + 0.1, 0.5, f"reload step {resumed}", fontsize=8)
    # zoom on the steps that matter: the axis ends a few steps after the kill, and the text at
    # the right edge says where both runs end
    right = min(total_steps, fail_at + 5)
    ax.axvspan(resumed, fail_at, color="#d62728", alpha=0.12,
               label=f"steps {resumed + 1}-{fail_at}: computed twice")
    for row in (rows["uninterrupted run"], rows["attempt 1 (restart)"]):
        ax.text(right + 0.1, row, f"… step {total_steps}: same weights", fontsize=7.5,
                va="center")
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels(list(rows), fontsize=8)
    ax.set_xlabel("optimizer step")
    ax.set_xticks(range(0, right + 1, 2 if right <= 24 else 4))
    ax.set_xlim(0, right + 6)
    ax.set_ylim(-0.6, 2.6)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", ncol=3, bbox_to_anchor=(0.55, 1.25))
    fig.subplots_adjust(left=0.2, right=0.98, bottom=0.18, top=0.82)
    return fig
