"""Small matplotlib helpers shared by the stages that draw curves (SFT probe curves, reports).

matplotlib is an optional dependency (the ``plots`` extra): every function returns ``False``
instead of raising when it is not installed, so a run never fails for want of a PNG. Figures are
written atomically (temp file, then rename) with the non-interactive Agg backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

from mlx_ssp.io import atomic_path

Series = dict[str, Sequence[Optional[float]]]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _clean(ys: Sequence[Optional[float]]) -> list[float]:
    # None and NaN both mean "not measured": matplotlib leaves a gap for NaN
    return [math.nan if y is None else float(y) for y in ys]


def line_chart(
    path: str | Path,
    x: Sequence[float],
    series: Series,
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    secondary: Optional[Series] = None,
    secondary_label: str = "",
    vline: Optional[float] = None,
    vline_label: str = "",
    ylim: Optional[tuple[float, float]] = None,
) -> bool:
    """Draw ``series`` (name -> y values aligned with ``x``) as lines with markers, optionally a
    second y axis (``secondary``, dashed), a vertical marker line and fixed y limits (``ylim``,
    e.g. (0, 1) for rates); save a PNG at ``path``.
    Returns False (and writes nothing) when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        handles = []
        for name, ys in series.items():
            (h,) = ax.plot(list(x), _clean(ys), marker="o", label=name)
            handles.append(h)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.grid(True, alpha=0.3)
        if secondary:
            ax2 = ax.twinx()
            for i, (name, ys) in enumerate(secondary.items()):
                (h,) = ax2.plot(list(x), _clean(ys), linestyle="--", color=f"C{len(series) + i}", label=name)
                handles.append(h)
            ax2.set_ylabel(secondary_label)
        if vline is not None:
            handles.append(ax.axvline(vline, color="black", linestyle=":", label=vline_label or None))
        if title:
            ax.set_title(title)
        ax.legend(handles=handles, labels=[h.get_label() for h in handles], loc="best", fontsize="small")
        fig.tight_layout()
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)
    return True
