"""Lesson 00 (Start here): how ``dpcourse.launch.spawn`` starts ranks from a notebook
("Running many processes from a notebook"): the notebook, the forkserver, the ranks, the
rendezvous store on rank 0 and the backend's connections between the ranks.
"""

from __future__ import annotations

from .common import new_figure

__all__ = ["spawn_figure"]


def spawn_figure(world_size: int = 2, backend: str = "gloo"):
    """Who starts whom and who talks to whom in one ``launch.spawn`` of ``world_size`` ranks."""
    from matplotlib.patches import FancyBboxPatch

    fig = new_figure(7.2, 3.6)
    ax = fig.add_axes([0.01, 0.01, 0.98, 0.9])
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 5)
    ax.axis("off")

    def box(x, y, text, colour, w=2.6, h=0.75):
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.04",
                                    fc=colour, ec="#444444", lw=0.8))
        ax.text(x, y, text, ha="center", va="center", fontsize=7.5)

    def arrow(a, b, text="", colour="#333333", style="-|>", ls="-", dx=0.0, dy=0.0):
        ax.annotate("", b, a, arrowprops=dict(arrowstyle=style, lw=0.9, color=colour,
                                              linestyle=ls, shrinkA=2, shrinkB=2))
        if text:
            ax.text((a[0] + b[0]) / 2 + dx, (a[1] + b[1]) / 2 + dy, text, fontsize=6.5,
                    color=colour, ha="center", va="center")

    box(2.0, 4.3, "notebook (parent)\nlaunch.spawn", "#cfe2f3")
    box(6.2, 4.3, "forkserver: a helper process\n(torch imported once)", "#eeeeee")
    arrow((3.3, 4.3), (4.9, 4.3), "start rank k", dy=0.18)
    xs = [1.4 + 7.2 * k / max(1, world_size - 1) for k in range(world_size)]
    for k, x in enumerate(xs):
        box(x, 2.0, f"rank {k}\nfn(rank, world_size)", "#d9ead3", w=2.2)
        arrow((6.2, 3.9), (x, 2.4), "fork" if k == world_size - 1 else "", dx=0.35)
        arrow((x - 0.5, 2.4), (1.6, 3.9), "pipe result_conn:\nresult, output" if k == 0 else "",
              colour="#1c4587", dx=-0.55)
        arrow((2.3, 3.9), (x + 0.1, 2.4), "pipe release_conn:\nexit now" if k == 0 else "",
              colour="#990000", dx=0.75, dy=0.15)
    box(xs[0], 0.6, "store: a key-value server\nTCPStore on 127.0.0.1:port\n"
        "(rank 0 hosts it: rendezvous)", "#fff2cc", w=3.0, h=1.05)
    for k, x in enumerate(xs):
        arrow((x, 1.6), (xs[0] + (0.6 if k else 0.0), 1.15), "", colour="#7f6000", ls="--")
    for a, b in zip(xs, xs[1:]):
        arrow((a + 1.1, 2.0), (b - 1.1, 2.0), f"{backend}: the collectives' data",
              colour="#38761d", style="<|-|>", dy=0.2)
    fig.suptitle(f"launch.spawn, {world_size} ranks: started by the forkserver, met at the "
                 f"store, talking over {backend}", fontsize=9)
    return fig
