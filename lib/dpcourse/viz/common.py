"""What every lesson uses to put things on the page: a figure, its PNG, its caption, and the
source of the code a lesson's claims depend on.

Figures are ``matplotlib.figure.Figure`` objects (not pyplot), so nothing is drawn twice or left
open, and they reach the notebook through :func:`show` as a **PNG** with a one-line caption:
nbval does not compare images, while an SVG embeds a date and would fail.
"""

from __future__ import annotations

import contextlib
import io

__all__ = ["new_figure", "figure_to_png", "show", "show_code", "folded_code_bundle",
           "folded_output"]


def new_figure(width: float = 6.0, height: float = 4.0, dpi: int = 80):
    """A matplotlib Figure that no pyplot state knows about, so only :func:`show` shows it."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=dpi)


def figure_to_png(fig, dpi: int | None = None) -> bytes:
    """The figure as PNG bytes (Agg, no backend needed). The same figure gives the same bytes:
    no date or software name is written into the file."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    # No bbox_inches="tight": it draws the figure twice; the layouts here leave no big margins.
    fig.savefig(buf, format="png", dpi=dpi or fig.dpi, metadata={"Software": None})
    return buf.getvalue()


def show(fig, caption: str | None = None, folded: str | None = None) -> None:
    """Display ``fig`` as a PNG in a notebook, then its one-line caption (what to see in it).

    Every figure in a lesson has a caption (tests/test_notebooks.py checks): pass it here. Works
    for pyplot figures too (``plt.gcf()``), which are then closed so they are not drawn twice.
    ``folded="▶ label"`` is for a figure that shows a lab's answer: the PNG and its caption go
    into one ``<details>`` block under ``label``, folded in every viewer like
    ``show_code(..., folded=label)`` (the cell's fold flag alone GitHub ignores).
    """
    try:
        from IPython.display import Image, Markdown, display
    except ImportError:  # plain Python: nothing to show on
        return
    if folded is not None:
        import base64
        import html

        png = base64.b64encode(figure_to_png(fig)).decode("ascii")
        body = f'<img src="data:image/png;base64,{png}"/>'
        if caption:
            body += f"\n<p><em>Figure — {html.escape(caption)}</em></p>"
        display(folded_code_bundle(body, folded, what="figure"), raw=True)
    else:
        display(Image(figure_to_png(fig)))
        if caption:
            display(Markdown(f"*Figure — {caption}*"))
    if getattr(fig, "number", None) is not None:  # a pyplot figure: forget it
        import matplotlib.pyplot as plt

        plt.close(fig)


def show_code(*objects, title: str | None = None, folded: str | None = None) -> None:
    """Display the source of functions or classes, syntax-highlighted, right where a lesson uses
    them: the code a lesson's claims depend on is read in the notebook, not hidden in the library.

    Strings are shown as they are (a snippet); anything else through ``inspect.getsource``.

    ``folded="▶ label"`` is for a lab's answer: the code goes into an HTML
    ``<details><summary>▶ label</summary>…</details>`` block, so it is one click away in
    JupyterLab, on the course website and in GitHub's static view alike (GitHub ignores the
    cell's fold metadata but honours ``<details>``), and the plain-text form of the output (what
    a viewer without HTML shows) says only that the code is folded, never the code
    (:func:`folded_code_bundle`).
    """
    import inspect

    from IPython.display import Code, Markdown, display

    if title:
        display(Markdown(f"**{title}**"))
    parts = [obj if isinstance(obj, str) else inspect.getsource(obj) for obj in objects]
    code = Code("\n\n".join(p.rstrip("\n") for p in parts) + "\n", language="python")
    if folded is None:
        display(code)
    else:
        display(folded_code_bundle(code._repr_html_(), folded), raw=True)


def folded_code_bundle(code_html: str, label: str, what: str = "code") -> dict[str, str]:
    """The mimebundle of ``show_code(..., folded=label)``: ``text/html`` holds the highlighted
    code inside ``<details>`` under ``label``; ``text/plain`` holds none of it, only where to
    open it (``what`` names what is folded: "code", or "output" for :func:`folded_output`)."""
    import html

    summary = html.escape(label)
    return {
        "text/html": (f'<details class="dpcourse-folded-code"><summary>{summary}</summary>\n'
                      f"{code_html}\n</details>"),
        "text/plain": (f"{label} [folded: the {what} is not shown as plain text; open "
                       "this output in JupyterLab, on the course website or on GitHub and "
                       "click the label]"),
    }


@contextlib.contextmanager
def folded_output(label: str):
    """What the ``with`` block prints (a lab's answer checked by claims) goes on the page as one
    HTML ``<details>`` block under ``label``, folded in every viewer like
    ``show_code(..., folded=label)``: its plain text says only that it is folded. Printed even
    when the block raises, so a failed claim's earlier lines are not lost."""
    import html

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        try:
            from IPython.display import display
        except ImportError:  # plain Python: print it
            print(buf.getvalue(), end="")
        else:
            pre = f"<pre>{html.escape(buf.getvalue())}</pre>"
            display(folded_code_bundle(pre, label, what="output"), raw=True)
