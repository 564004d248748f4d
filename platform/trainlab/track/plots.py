"""The two pictures every run gets: loss curves and delivered mix shares.

Built with matplotlib's object API on the Agg canvas (no pyplot global state,
no display), from plain `{name: [(step, value), ...]}` series, so the training
callback, the notebook and tests draw the same figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Series = Sequence[tuple[int, float]]


def _figure(title: str, ylabel: str) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _plot(ax: Axes, series: Series, **kwargs: Any) -> str | None:
    """Draw one series; return its colour (None when it is empty)."""
    if not series:
        return None
    steps, values = zip(*series, strict=True)
    return ax.plot(steps, values, **kwargs)[0].get_color()


def _empty_note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def loss_curve_figure(train: Series, val: Mapping[str, Series], title: str = "loss") -> Figure:
    """Training loss and validation loss per source (and "all") against step."""
    fig, ax = _figure(title, "loss")
    _plot(ax, train, label="train", linewidth=1.2)
    for source, series in sorted(val.items()):
        _plot(
            ax,
            series,
            label=f"val {source}",
            marker="o",
            markersize=3,
            linestyle="-" if source == "all" else "--",
        )
    if train or any(val.values()):
        ax.legend(loc="upper right")
    else:
        _empty_note(ax, "no loss logged")
    return fig


def mix_share_figure(
    shares: Mapping[str, Series], targets: Mapping[str, float], title: str = "delivered token share"
) -> Figure:
    """Delivered token share per source against step, with the target shares dashed."""
    fig, ax = _figure(title, "share of tokens")
    colors = {source: _plot(ax, series, label=source) for source, series in sorted(shares.items())}
    for source, target in sorted(targets.items()):
        ax.axhline(
            target,
            linestyle="--",
            linewidth=0.8,
            color=colors.get(source) or "gray",
            label=f"{source} target",
        )
    if any(shares.values()) or targets:
        ax.legend(loc="upper right", fontsize="small")
        ax.set_ylim(0, 1)
    else:
        _empty_note(ax, "no mix shares logged")
    return fig


def normalized_mix(mix: Mapping[str, float]) -> dict[str, float]:
    """Config mix weights as shares summing to 1 (empty stays empty)."""
    total = sum(mix.values())
    return {k: v / total for k, v in mix.items()} if total > 0 else {}


# --------------------------------------------------------------------------- many runs

GRID_COLUMNS = 4  # mix panels per row, whatever the number of runs


def runs_loss_figure(curves: Mapping[str, Mapping[str, Series]]) -> Figure:
    """Training (solid) and validation (dashed, same colour) loss of many runs,
    `curves` = {run label: {"loss": series, "val_loss/all": series}}: one legend
    entry per run, outside the axes on the right in as many columns as it needs,
    so it never covers the curves."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = max(len(curves), 1)
    columns = 1 + (n - 1) // 20  # 20 labels per legend column
    fig = Figure(figsize=(9 + 2.5 * columns, 5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set(title="loss (solid: train, dashed: val_loss/all)", xlabel="step", ylabel="loss")
    ax.grid(True, alpha=0.3)
    for label, series in curves.items():
        color = _plot(ax, series.get("loss") or [], label=label, linewidth=1.0)
        _plot(
            ax,
            series.get("val_loss/all") or [],
            linestyle="--",
            color=color,
            marker="o",
            markersize=2,
        )
    if curves:
        fig.legend(loc="outside right upper", ncols=columns, fontsize="small")
    else:
        _empty_note(ax, "no runs")
    return fig


def runs_mix_figure(
    shares: Mapping[str, Mapping[str, Series]], targets: Mapping[str, Mapping[str, float]]
) -> Figure:
    """Delivered share per source of many runs, one small panel per run in rows of
    GRID_COLUMNS (the figure grows downwards, never wider than GRID_COLUMNS
    panels), one legend of the sources for all panels; targets dashed."""
    import math

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = max(len(shares), 1)
    cols = min(n, GRID_COLUMNS)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(3.6 * cols, 2.8 * rows + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)
    colors: dict[str, str] = {}
    palette = iter(f"C{i}" for i in range(10_000))
    for ax, (label, per_source) in zip(axes.flat, shares.items(), strict=False):
        for source, series in sorted(per_source.items()):
            color = colors.setdefault(source, next(palette))
            _plot(ax, series, color=color, label=source, linewidth=1.0)
            if source in targets.get(label, {}):
                ax.axhline(targets[label][source], linestyle="--", linewidth=0.8, color=color)
        ax.set_title(label, fontsize="small")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(shares) :]:
        ax.set_visible(False)
    if colors:
        handles = [axes.flat[0].plot([], [], color=c, label=s)[0] for s, c in colors.items()]
        fig.legend(
            handles=handles, loc="outside lower center", ncols=min(len(colors), 8), fontsize="small"
        )
    fig.suptitle("delivered token share (dashed: target)")
    return fig
