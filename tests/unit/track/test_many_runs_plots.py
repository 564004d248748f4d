"""The comparison figures scale with the number of runs (16 here): the legend
sits outside the loss axes, the mix panels wrap into rows."""

from __future__ import annotations

import io

from trainlab.track.plots import GRID_COLUMNS, runs_loss_figure, runs_mix_figure

RUNS = [f"tiny-{i:02d}" for i in range(16)]


def test_loss_legend_of_16_runs_does_not_cover_the_curves():
    curves = {
        r: {
            "loss": [(s, 9 - s / 10 - i / 100) for s in range(0, 60, 5)],
            "val_loss/all": [(20, 7.0), (40, 6.5)],
        }
        for i, r in enumerate(RUNS)
    }
    fig = runs_loss_figure(curves)
    fig.savefig(io.BytesIO(), format="png")  # lays the figure out
    (ax,) = fig.axes
    (legend,) = fig.legends
    renderer = fig.canvas.get_renderer()
    box, axes_box = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert box.x0 >= axes_box.x1  # right of the axes, not over them
    assert len(legend.get_texts()) == 16
    assert fig.get_figwidth() <= 12


def test_mix_panels_of_16_runs_wrap_into_rows():
    shares = {r: {"code": [(5, 0.5), (10, 0.52)], "docs": [(5, 0.5), (10, 0.48)]} for r in RUNS}
    targets = {r: {"code": 0.5, "docs": 0.5} for r in RUNS}
    fig = runs_mix_figure(shares, targets)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 16
    assert fig.get_figwidth() <= 3.6 * GRID_COLUMNS + 0.1
    rows = {ax.get_subplotspec().rowspan.start for ax in visible}
    assert len(rows) == 16 // GRID_COLUMNS
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["code", "docs"]
