"""``report.html``: a run drawn from its timeline, one self-contained file to look at.

:func:`write_html_report` reads a run directory (its ``timeline.jsonl``, the shards and
``report.json``) and writes one HTML file with inline SVG plots and tables, and no
script, style sheet, font or image from anywhere else: it opens offline, from a mail or
a shared folder. It works for a run that finished, one that was interrupted or killed,
and one still running (drawn as far as it got).

What it shows: throughput over time (answers a second, overall and per server, and the
rows written), with evictions and re-admissions marked; the time a request spends in
flight on each server; error rows by type over time; the progress and its tail (the
time from 99% of the rows to the last); a summary table of the run and one row per
server; every change of a server's state. For a sharded job (``--shard``), a table of
its shards, then each shard's sections.

Everything it reads is checked (:mod:`llm_annotator.jobs.files`, the readers of each
file): a link, a FIFO or a file of the wrong shape in the run directory is one
:class:`~llm_annotator.errors.RunDirectoryError` naming it, and ``report.html`` is
written under a fresh temporary name, never through an entry planted there.

Three modules, each over the one below: ``page`` writes the HTML, ``plots`` draws the
series, and ``series`` reads the timeline and the status into figures
(:func:`run_series`, the tables' rows). The plots need matplotlib (``pip install
'llm-annotator[report]'``); the series are computed without it, so they are tested on
their own.
"""

from llm_annotator.jobs.run_report.page import (
    HTML_REPORT_NAME,
    write_html_report,
    write_runs_report,
)
from llm_annotator.jobs.run_report.series import MAX_POINTS, RunSeries, run_series

__all__ = [
    "HTML_REPORT_NAME",
    "MAX_POINTS",
    "RunSeries",
    "run_series",
    "write_html_report",
    "write_runs_report",
]
