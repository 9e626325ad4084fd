"""Lesson 05 (TensorFlow's MirroredStrategy): one process driving N replicas beside DDP's N
processes (§2).
"""

from __future__ import annotations

from .common import new_figure

__all__ = ["mirrored_vs_ddp_figure"]


def mirrored_vs_ddp_figure(n: int = 2):
    """Who runs what: MirroredStrategy (one process driving n replicas) beside DDP (n processes,
    one replica each). Both all-reduce the gradients at the end of every step."""
    from matplotlib.patches import FancyBboxPatch

    fig = new_figure(9, 3.4)
    for k, (title, one_process) in enumerate((("TF MirroredStrategy", True),
                                              ("PyTorch DDP", False))):
        ax = fig.add_axes([0.02 + 0.5 * k, 0.02, 0.46, 0.86])
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 6)
        ax.axis("off")
        ax.set_title(title, fontsize=10)
        width = 8.6 / n
        if one_process:
            ax.add_patch(FancyBboxPatch((0.4, 1.5), 9.2, 4.2, boxstyle="round,pad=0.05",
                                        fc="#fff2cc", ec="#444444"))
            ax.text(5, 5.3, "one Python process: strategy.run(step_fn)", ha="center", fontsize=8)
        for r in range(n):
            x = 0.7 + r * width
            if not one_process:
                ax.add_patch(FancyBboxPatch((x - 0.15, 1.5), width - 0.3, 4.2,
                                            boxstyle="round,pad=0.05", fc="#fff2cc", ec="#444444"))
                ax.text(x + width / 2 - 0.3, 5.3, f"process, rank {r}", ha="center", fontsize=8)
            ax.add_patch(FancyBboxPatch((x, 2.0), width - 0.6, 2.6, boxstyle="round,pad=0.05",
                                        fc="#d9ead3", ec="#444444"))
            ax.text(x + width / 2 - 0.3, 3.3, f"replica {r}\nweights copy\n1/{n} of the batch",
                    ha="center", va="center", fontsize=7.5)
        ax.add_patch(FancyBboxPatch((0.6, 0.2), 8.8, 0.8, boxstyle="round,pad=0.05",
                                    fc="#cfe2f3", ec="#444444"))
        ax.text(5, 0.6, "all-reduce of gradients: SUM in apply_gradients" if one_process
                else "all-reduce of gradients: AVERAGE inside backward()", ha="center",
                va="center", fontsize=8)
    return fig
