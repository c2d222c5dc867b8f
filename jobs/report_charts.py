"""matplotlib (Agg) helpers shared by the report and the study: one look for every chart.

matplotlib is the optional `report` extra; `require_matplotlib` fails with one line naming
the install command when it is missing.
"""

from __future__ import annotations

import io
from typing import Any

INSTALL_HINT = "matplotlib is not installed: pip install 'adt-tree[report]'"
PALETTE = ["#3b6fb6", "#e0823d", "#4a9d6b", "#c0504d", "#8064a2", "#4bacc6", "#9b8b3d", "#7f7f7f"]


class MissingDependency(RuntimeError):
    """An optional dependency the command needs is not installed (the message says how)."""


def require_matplotlib() -> Any:
    """matplotlib.pyplot on the Agg backend, styled; MissingDependency when absent."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency(INSTALL_HINT) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from cycler import cycler

    plt.rcParams.update({
        "font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold", "axes.labelsize": 10,
        "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
        "legend.frameon": False, "figure.dpi": 100, "savefig.dpi": 100, "axes.prop_cycle": cycler(color=PALETTE),
        "font.family": "DejaVu Sans",
    })
    return plt


def figure(rows: int = 1, cols: int = 1, width: float = 6.0, height: float = 3.6):
    """(figure, flat list of axes)."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False, layout="constrained")
    return fig, list(axes.ravel())


def style_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, loc="left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def empty_note(ax, text: str) -> None:
    """An axis that says why it has no data (a chart is never silently blank)."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, color="#666", wrap=True, transform=ax.transAxes)


def png(fig) -> bytes:
    """The figure as PNG bytes (the figure is closed)."""
    plt = require_matplotlib()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="white")
    plt.close(fig)
    return buf.getvalue()
