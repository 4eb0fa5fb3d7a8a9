"""Live metrics of a running job, in Prometheus's text format (``--metrics-port``).

The job's :class:`~llm_annotator.jobs.watch.timeline.RunWatch` hands :class:`LiveMetrics` a
snapshot every second; a scrape reads the latest one, in the HTTP server's own thread,
so that a scrape never touches the job's state and costs the job nothing.

The metrics (counters count this run; gauges are now):

====================================================  =======  ==========================
name                                                  type     labels
====================================================  =======  ==========================
``llm_annotator_rows``                                gauge    rows the job takes
``llm_annotator_rows_done``                           gauge    rows done, resumed included
``llm_annotator_rows_processed_total``                counter  ``outcome`` (answered,
                                                               failed)
``llm_annotator_rows_failed_total``                   counter  ``error_type``
``llm_annotator_rows_per_second``                     gauge    over the last half minute
``llm_annotator_eta_seconds``                         gauge    (absent when unknown)
``llm_annotator_output_tokens_total``                 counter
``llm_annotator_queued_samples``                      gauge
``llm_annotator_in_flight_requests``                  gauge
``llm_annotator_server_up``                           gauge    ``server``: 1 while it
                                                               takes work
``llm_annotator_server_state``                        gauge    ``server``, ``state``: 1
                                                               for its state, 0 others
``llm_annotator_server_in_flight_requests``           gauge    ``server``
``llm_annotator_server_rows_total``                   counter  ``server``: rows it
                                                               answered (output rows)
``llm_annotator_server_evictions_total``              counter  ``server``
``llm_annotator_server_readmissions_total``           counter  ``server``
``llm_annotator_server_requeued_samples_total``       counter  ``server``
``llm_annotator_server_hedged_requests_total``        counter  ``server``
====================================================  =======  ==========================

The server counters are the pool's, over its life (a pool used for one job: this run).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import structlog
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from llm_annotator.errors import ConfigurationError
from llm_annotator.jobs.watch.timeline import Snapshot
from llm_annotator.pool.lifecycle import MemberState

log = structlog.get_logger(__name__)

STATES = tuple(state.value for state in MemberState)
"""A server's states, each one a series of ``llm_annotator_server_state``."""


class LiveMetrics(Collector):
    """The latest snapshot of a job, as Prometheus metrics.

    Examples:
        >>> from prometheus_client import generate_latest
        >>> from prometheus_client.registry import CollectorRegistry
        >>> from llm_annotator.jobs.watch.timeline import Snapshot
        >>> metrics = LiveMetrics()
        >>> registry = CollectorRegistry()
        >>> registry.register(metrics)
        >>> metrics.publish(Snapshot(t=1.0, wall=0.0, total=10, done=4, rows=4, failed=1,
        ...     output_tokens=30, by_error_type={"read_timeout": 1}, queued=6, in_flight=0,
        ...     servers=()))
        >>> text = generate_latest(registry).decode()
        >>> 'llm_annotator_rows_processed_total{outcome="failed"} 1.0' in text
        True
    """

    def __init__(self) -> None:
        self._latest: Snapshot | None = None
        self.server: Any = None
        self._thread: threading.Thread | None = None

    def publish(self, snapshot: Snapshot) -> None:
        """Serve this snapshot from now on (one reference swap: safe across threads)."""
        self._latest = snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self._latest
        if snapshot is None:
            return
        yield _gauge("rows", "Rows the job takes.", snapshot.total)
        yield _gauge("rows_done", "Rows done, rows of earlier runs included.", snapshot.done)
        rows = CounterMetricFamily(
            "llm_annotator_rows_processed",
            "Rows this run wrote, by outcome.",
            labels=["outcome"],
        )
        rows.add_metric(["answered"], snapshot.rows - snapshot.failed)
        rows.add_metric(["failed"], snapshot.failed)
        yield rows
        failed = CounterMetricFamily(
            "llm_annotator_rows_failed",
            "Error rows this run wrote, by error type.",
            labels=["error_type"],
        )
        for kind, count in sorted(snapshot.by_error_type.items()):
            failed.add_metric([kind], count)
        yield failed
        yield _gauge(
            "rows_per_second", "Rows a second over the last half minute.", snapshot.rows_per_second
        )
        if snapshot.eta_seconds is not None:
            yield _gauge("eta_seconds", "Seconds left at the recent rate.", snapshot.eta_seconds)
        yield CounterMetricFamily(
            "llm_annotator_output_tokens",
            "Output tokens this run generated, regenerations included.",
            value=snapshot.output_tokens,
        )
        yield _gauge("queued_samples", "Samples waiting in the pool's queue.", snapshot.queued)
        yield _gauge("in_flight_requests", "Requests in flight.", snapshot.in_flight)
        yield from _server_metrics(snapshot)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve the metrics over HTTP on ``host:port`` (0: a free port) from a thread of
        its own; returns the port.

        Raises:
            ConfigurationError: The port cannot be bound (taken, or not allowed).
        """
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            self.server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as error:
            raise ConfigurationError(
                f"cannot serve the metrics on {host}:{port} ({error.strerror or error}); "
                "give another --metrics-port, or 0 for any free port"
            ) from None
        bound = int(self.server.server_port)
        log.info("metrics_serving", url=f"http://{_host_for_url(host)}:{bound}/metrics")
        return bound

    def stop(self) -> None:
        """Stop serving (the port is free once this returns)."""
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"llm_annotator_{name}", documentation, value=value)


def _server_metrics(snapshot: Snapshot) -> Iterator[Metric]:
    up = GaugeMetricFamily(
        "llm_annotator_server_up", "1 while the server takes work.", labels=["server"]
    )
    state = GaugeMetricFamily(
        "llm_annotator_server_state",
        "1 for the server's state now, 0 for the others.",
        labels=["server", "state"],
    )
    in_flight = GaugeMetricFamily(
        "llm_annotator_server_in_flight_requests",
        "Requests in flight on the server.",
        labels=["server"],
    )
    counters = {
        "rows": ("Rows of this run the server answered (error rows included).", "rows"),
        "evictions": ("Times the server was evicted.", "evictions"),
        "readmissions": ("Times the server rejoined.", "readmissions"),
        "requeued_samples": ("Samples taken from the server and sent elsewhere.", "requeued"),
        "hedged_requests": ("Copies of slow samples sent to the server.", "hedged"),
    }
    families = {
        name: CounterMetricFamily(f"llm_annotator_server_{name}", doc, labels=["server"])
        for name, (doc, _) in counters.items()
    }
    for server in snapshot.servers:
        now = server.stats.state
        up.add_metric([server.url], 1.0 if now == MemberState.HEALTHY.value else 0.0)
        for name in STATES:
            state.add_metric([server.url, name], 1.0 if now == name else 0.0)
        in_flight.add_metric([server.url], server.stats.in_flight)
        for name, (_, field) in counters.items():
            families[name].add_metric([server.url], server.value(field))
    yield up
    yield state
    yield in_flight
    yield from families.values()


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host
