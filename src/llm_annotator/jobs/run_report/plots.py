"""The report's plots: a run's series drawn with matplotlib, each as an inline SVG.

matplotlib is imported only here, when a report is drawn (the ``report`` extra).
"""

from __future__ import annotations

import io
from typing import Any

from llm_annotator.errors import ConfigurationError
from llm_annotator.jobs.run_report.series import RunSeries


def svg_plots(series: RunSeries) -> list[tuple[str, str]]:
    """(title, inline SVG) of each plot. Drawn on figures of their own (no pyplot), in
    a context of their own: a caller's backend, figures and settings stay as they are."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigurationError(
            "the HTML report draws its plots with matplotlib, which is not installed: "
            "pip install 'llm-annotator[report]'"
        ) from None

    def figure(width: float, height: float) -> tuple[Any, Any]:
        drawn = Figure(figsize=(width, height))
        return drawn, drawn.subplots()

    style: dict[Any, Any] = {"svg.fonttype": "path", "font.size": 9, "svg.hashsalt": "report"}
    with matplotlib.rc_context(style):
        plots = [
            ("Throughput over time", _throughput(figure, series)),
            ("Time a request spends in flight, by server", _per_row(figure, series)),
            ("Error rows by type over time", _errors(figure, series)),
            ("Progress and the tail", _progress(figure, series)),
        ]
    return [(title, svg) for title, svg in plots if svg]


def _svg(figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.find("<svg") :]


def _marks(axes: Any, series: RunSeries) -> None:
    for number, (x, server, _) in enumerate(series.evictions):
        axes.axvline(
            x,
            color="#c0392b",
            linestyle="--",
            linewidth=1,
            label="eviction" if number == 0 else None,
        )
        axes.annotate(
            _short(server),
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color="#c0392b",
        )
    for number, (x, _) in enumerate(series.readmissions):
        axes.axvline(
            x,
            color="#27ae60",
            linestyle=":",
            linewidth=1.2,
            label="re-admission" if number == 0 else None,
        )
    for number, (x, _) in enumerate(series.runs[1:]):
        axes.axvline(
            x,
            color="#7f8c8d",
            linestyle="-.",
            linewidth=1,
            label="resumed" if number == 0 else None,
        )


def _time_axes(axes: Any, series: RunSeries, ylabel: str) -> None:
    """The events marked, and the axes of a plot over the job's time."""
    _marks(axes, series)
    axes.set_xlim(0, max(series.end, 1.0))
    axes.set_xlabel("seconds since the job started")
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)


def _throughput(figure: Any, series: RunSeries) -> str:
    drawn, axes = figure(9, 3.6)
    if series.rate:
        xs, ys = zip(*series.rate, strict=True)
        axes.plot(xs, ys, color="#222222", linewidth=1.8, label="all servers")
    for url, points in series.server_rate.items():
        xs, ys = zip(*points, strict=True)
        axes.plot(xs, ys, linewidth=1, label=_short(url))
    if series.written and series.server_rate:
        xs, ys = zip(*series.written, strict=True)
        axes.plot(xs, ys, color="#999999", linewidth=1, linestyle="--", label="rows written")
    _time_axes(axes, series, "answers / s")
    _legend(axes)
    return _svg(drawn)


def _per_row(figure: Any, series: RunSeries) -> str:
    known = {u: s for u, s in series.seconds_per_row.items() if s is not None}
    if not known:
        return ""
    drawn, axes = figure(9, 0.5 + 0.35 * len(known))
    names = [_short(u) for u in known]
    values = list(known.values())
    axes.barh(names, values, color="#2e86c1")
    for y, value in enumerate(values):
        axes.annotate(f" {value:.2f} s", (value, y), va="center", fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("mean seconds in flight per answer (requests in flight / answers per second)")
    axes.grid(axis="x", alpha=0.3)
    return _svg(drawn)


def _errors(figure: Any, series: RunSeries) -> str:
    drawn, axes = figure(9, 2.8)
    for kind, points in sorted(series.errors.items()):
        xs, ys = zip(*points, strict=True)
        axes.step(xs, ys, where="post", label=kind)
    if not series.errors:
        axes.text(
            0.5,
            0.5,
            "no error rows",
            ha="center",
            va="center",
            transform=axes.transAxes,
            color="#555555",
        )
    _time_axes(axes, series, "error rows")
    _legend(axes)
    return _svg(drawn)


def _progress(figure: Any, series: RunSeries) -> str:
    if not series.done or series.total <= 0:
        return ""
    drawn, axes = figure(9, 2.8)
    xs, ys = zip(*series.done, strict=True)
    axes.plot(xs, [100.0 * y / series.total for y in ys], color="#8e44ad", linewidth=1.5)
    if series.tail is not None:
        start, end = series.tail
        axes.axvspan(
            start,
            end,
            color="#f39c12",
            alpha=0.25,
            label=f"tail: 99% to 100% in {end - start:.1f} s",
        )
        axes.legend(loc="lower right", fontsize=8)
    _time_axes(axes, series, "% of the rows done")
    axes.set_ylim(0, 101)
    return _svg(drawn)


def _legend(axes: Any) -> None:
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def _short(url: str) -> str:
    for prefix in ("http://", "https://"):
        if url.startswith(prefix):
            url = url[len(prefix) :]
    return url.removesuffix("/v1")
