"""What every PNG figure of ops/ shares: labelled, gridded axes, and how a figure is saved."""

from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure


def label_axes(
    ax: Axes, xlabel: str, ylabel: str, title: str | None = None, *, legend: int | None = 8
) -> None:
    """Axis labels, an optional title, a light grid and (with `legend`, a font size) a legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    if legend:
        ax.legend(fontsize=legend)


def save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
