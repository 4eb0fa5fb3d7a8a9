"""VLLMQueueAnnotator against real vLLM servers that die, hang, never answer or start late.

Each case runs >= 1,500 conversations over three base URLs and asserts that every
conversation has exactly one successful Response. Two of the servers are the session's
shared ones; the third, the one that fails, is started by the test itself. The time
from the fault to the eviction is printed (run pytest with -s to see it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from llm_annotator import PoolExhaustedError, VLLMOnlineRuntimeOptions, VLLMQueueAnnotator
from llm_annotator.local import LocalServers, pick_free_ports, start_local_servers

pytestmark = [pytest.mark.integration, pytest.mark.faults]

OPTIONS = VLLMOnlineRuntimeOptions(max_completion_tokens=8, temperature=0.0)
N = 1500


def conversations(n: int = N) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"review {i}: it was fine"}] for i in range(n)]


def assert_exactly_one_success_each(responses: list[Any], n: int = N) -> None:
    assert len(responses) == n
    failed = [r for r in responses if not r.ok]
    assert not failed, f"{len(failed)} error rows, first: {failed[0].error}"


class Watch:
    """Run ``action`` from a thread once the pool has completed ``after`` samples, then
    time how long until the target member is evicted."""

    def __init__(
        self, pool: VLLMQueueAnnotator, after: int, action: Callable[[], None], target: str
    ) -> None:
        self.pool, self.after, self.action, self.target = pool, after, action, target
        self.fault_at: float | None = None
        self.evicted_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and self.pool.statistics().completed < self.after:
            time.sleep(0.02)
        self.action()
        self.fault_at = time.monotonic()
        while time.monotonic() < deadline:
            if self.pool.statistics().member(self.target).evictions > 0:
                self.evicted_at = time.monotonic()
                return
            time.sleep(0.02)

    @property
    def seconds_to_eviction(self) -> float:
        self.thread.join(timeout=60)
        assert self.fault_at is not None and self.evicted_at is not None
        return self.evicted_at - self.fault_at


def timed_run(pool: VLLMQueueAnnotator, n: int = N) -> tuple[list[Any], float]:
    started = time.monotonic()
    responses = pool.batch_generate(messages=conversations(n), options=OPTIONS)
    return responses, time.monotonic() - started


def test_baseline_without_fault(vllm_servers: LocalServers) -> None:
    """The reference run: the shared servers alone, no fault."""
    with VLLMQueueAnnotator(vllm_servers.base_urls, batch_size=128) as pool:
        responses, seconds = timed_run(pool)
    assert_exactly_one_success_each(responses)
    print(f"\nbaseline, 2 servers, {N} conversations: {seconds:.1f} s")


def test_sigkill_a_third_of_the_way(vllm_servers: LocalServers, start_vllm: Any) -> None:
    """SIGKILL one of three servers after a third of the work: its samples move to the
    others, no error rows."""
    victim = start_vllm(1)
    urls = [*vllm_servers.base_urls, victim.base_urls[0]]
    n = 4 * N  # long enough that the killed server still holds work when it dies
    with VLLMQueueAnnotator(urls, batch_size=128) as pool:
        _, without_fault = timed_run(pool, n)
    with VLLMQueueAnnotator(urls, batch_size=128) as pool:
        watch = Watch(pool, n // 3, victim[0].kill, victim.base_urls[0])
        responses, seconds = timed_run(pool, n)
        stats = pool.statistics().member(victim.base_urls[0])
    assert_exactly_one_success_each(responses, n)
    assert stats.evictions == 1
    assert stats.requeued > 0
    assert Counter(r.server for r in responses)[victim.base_urls[0]] == stats.completed
    print(
        f"\nSIGKILL: evicted {watch.seconds_to_eviction:.2f} s after the kill; "
        f"run {seconds:.1f} s, {without_fault:.1f} s without the fault"
    )


def test_sigstop_is_detected_and_sigcont_readmits(
    vllm_servers: LocalServers, start_vllm: Any
) -> None:
    """SIGSTOP one server mid-run (hung: TCP still accepts). With the default health
    settings it is evicted within 30 s and its samples answered elsewhere; after SIGCONT
    it is re-admitted and given work again (within three calls)."""
    victim = start_vllm(1)
    url = victim.base_urls[0]
    urls = [*vllm_servers.base_urls, url]
    n = 4 * N  # long enough that the stopped server still holds work when it stops
    with VLLMQueueAnnotator(urls, batch_size=128) as pool:
        _, without_fault = timed_run(pool, n)
    # No tail hedge: it would answer the stopped server's samples elsewhere before the
    # health checks evict it, and the eviction is what this test measures.
    with VLLMQueueAnnotator(urls, batch_size=128, hedge_tail=False) as pool:
        watch = Watch(pool, n // 3, victim[0].pause, url)
        responses, seconds = timed_run(pool, n)
        assert_exactly_one_success_each(responses, n)
        detected = watch.seconds_to_eviction
        assert detected < 30
        victim[0].resume()
        # Re-admission waits out a probation and a test completion; on a loaded machine
        # a whole call may end before it, so a few calls (bounded) are given.
        served_after = 0
        for _ in range(3):
            again, _ = timed_run(pool)
            assert_exactly_one_success_each(again)
            served_after = Counter(r.server for r in again)[url]
            if served_after:
                break
        stats = pool.statistics().member(url)
    assert stats.evictions == 1
    assert stats.readmissions == 1
    assert served_after > 0
    print(
        f"\nSIGSTOP: evicted {detected:.2f} s after the stop; "
        f"run {seconds:.1f} s, {without_fault:.1f} s without the fault"
    )


def engine_core_pid(server_pid: int) -> int:
    """The pid of the engine core process in a vLLM server's process group."""
    group = os.getpgid(server_pid)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == server_pid:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
            if os.getpgid(int(entry)) == group and b"EngineCore" in command:
                return int(entry)
        except OSError:
            continue  # gone meanwhile
    raise AssertionError(f"no EngineCore process in the group of {server_pid}")


class HealthLog:
    """Ask a server's /health every half second from a thread; keep what it answered."""

    def __init__(self, url: str) -> None:
        self.url = url.removesuffix("/v1") + "/health"
        self.answers: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import urllib.request

        for _ in range(2000):  # bounded: 1,000 s at most
            if self.stop.wait(0.5):
                return
            try:
                with urllib.request.urlopen(self.url, timeout=2) as answer:
                    self.answers.append(str(answer.status))
            except Exception as exc:  # what it said is the point, whatever it was
                self.answers.append(type(exc).__name__)

    def close(self) -> list[str]:
        self.stop.set()
        self.thread.join(timeout=10)
        return self.answers


def test_a_hung_engine_behind_a_live_api_server_is_found_by_progress(
    vllm_servers: LocalServers, start_vllm: Any
) -> None:
    """SIGSTOP on the engine core process only, a third of the way through: the API
    server keeps answering /health 200, no request makes progress. The member is taken
    for hung after its stall window (its /metrics counters stand still), its requests
    are cancelled and answered elsewhere, every sample succeeds; after SIGCONT a test
    completion re-admits it and it gets work again. No tail hedge: it would answer the
    stuck samples elsewhere first, and the detection is what this measures."""
    victim = start_vllm(1)
    url = victim.base_urls[0]
    urls = [*vllm_servers.base_urls, url]
    engine = engine_core_pid(victim[0].pid)
    n = 4 * N
    settings: dict[str, Any] = {"batch_size": 128, "hedge_tail": False, "stall_window": 10.0}
    with VLLMQueueAnnotator(urls, **settings) as pool:
        _, without_fault = timed_run(pool, n)
    health: list[HealthLog] = []

    def stop_engine() -> None:
        os.kill(engine, signal.SIGSTOP)
        health.append(HealthLog(url))

    try:
        with VLLMQueueAnnotator(urls, **settings) as pool:
            watch = Watch(pool, n // 3, stop_engine, url)
            responses, seconds = timed_run(pool, n)
            assert_exactly_one_success_each(responses, n)
            detected = watch.seconds_to_eviction
            said = health[0].close()
            stats = pool.statistics().member(url)
            assert stats.evictions == 1
            assert (stats.last_error or "").startswith("hung:"), stats.last_error
            assert "stood still" in (stats.last_error or "")
            os.kill(engine, signal.SIGCONT)
            # As long a run as the first: its probation (a few seconds) must end while
            # the others still have work, or a short run is over before it is back.
            again, _ = timed_run(pool, n)
            after = pool.statistics().member(url)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGCONT)
    assert_exactly_one_success_each(again, n)
    assert "200" in said  # /health could not tell: progress did
    assert after.readmissions == 1
    assert Counter(r.server for r in again)[url] > 0
    assert seconds <= without_fault + detected + 30  # + the requeued work, on 2 noisy cores
    print(
        f"\nengine SIGSTOP: evicted {detected:.2f} s after the stop ({stats.last_error}); "
        f"/health meanwhile: {Counter(said)}; run {seconds:.1f} s, {without_fault:.1f} s "
        f"without the fault"
    )


def test_listener_that_never_accepts(vllm_servers: LocalServers, blackhole_url: str) -> None:
    """A base URL whose listener never accepts (connect timeout) costs nothing."""
    with VLLMQueueAnnotator([*vllm_servers.base_urls, blackhole_url], batch_size=128) as pool:
        responses, seconds = timed_run(pool)
        stats = pool.statistics().member(blackhole_url)
    assert_exactly_one_success_each(responses)
    assert stats.completed == 0
    assert stats.state in ("joining", "evicted")  # its first probe may outlast the run
    print(f"\nnever-accepting listener: run {seconds:.1f} s")


def test_url_with_nothing_behind_it(vllm_servers: LocalServers) -> None:
    """A base URL where nothing listens (connection refused) costs nothing."""
    (port,) = pick_free_ports(1)
    refused = f"http://127.0.0.1:{port}/v1"
    with VLLMQueueAnnotator([*vllm_servers.base_urls, refused], batch_size=128) as pool:
        responses, seconds = timed_run(pool)
        stats = pool.statistics().member(refused)
    assert_exactly_one_success_each(responses)
    assert stats.completed == 0
    print(f"\nrefused URL: run {seconds:.1f} s")


@contextlib.contextmanager
def lower_priority(servers: LocalServers, niceness: int = 15) -> Iterator[None]:
    """Run the given servers at a lower CPU priority for a while.

    On a cluster a late server starts on its own node; here it shares two cores with
    servers that are busy, and would take minutes to start. Lowering the busy servers'
    priority gives it the CPU its own node would.
    """
    groups = [os.getpgid(server.pid) for server in servers]
    for group in groups:
        os.setpriority(os.PRIO_PGRP, group, niceness)
    try:
        yield
    finally:
        for group in groups:
            with contextlib.suppress(OSError):  # raising priority again needs root
                os.setpriority(os.PRIO_PGRP, group, 0)


@pytest.mark.timeout(600)
def test_late_server_joins_and_gets_work(vllm_servers: LocalServers) -> None:
    """A server in the list that starts 20 s after the job began joins and receives work.

    The job is a series of calls on one pool, as an annotation job drives it, each of
    1,500 conversations with exactly one success each and a second's pause between
    them, until the late server has answered some (bounded at 480 s: on this loaded
    2-core machine its start-up takes from 30 s to well over a minute, and once, beside
    a job of calls of 6,000 without pauses, 3 min 45 s; the pauses leave it some CPU)."""
    (port,) = pick_free_ports(1)
    late_url = f"http://127.0.0.1:{port}/v1"
    late: list[LocalServers] = []

    def start_late() -> None:
        late.append(start_local_servers(1, ports=[port], wait=False))

    timer = threading.Timer(20.0, start_late)
    started = time.monotonic()
    calls = 0
    try:
        with (
            lower_priority(vllm_servers),
            VLLMQueueAnnotator(
                [*vllm_servers.base_urls, late_url], batch_size=128, health_check_interval=2.0
            ) as pool,
        ):
            timer.start()
            while time.monotonic() - started < 480:
                responses, _ = timed_run(pool, N)
                assert_exactly_one_success_each(responses, N)
                calls += 1
                if pool.statistics().member(late_url).completed > 0:
                    break
                time.sleep(1.0)
            stats = pool.statistics().member(late_url)
        assert stats.readmissions == 1
        assert stats.completed > 0
        assert Counter(r.server for r in responses)[late_url] == stats.completed
        print(
            f"\nlate start: joined {time.monotonic() - started:.0f} s into the job (call "
            f"{calls}) and answered {stats.completed} of its {N} conversations"
        )
    finally:
        timer.cancel()
        timer.join()
        for servers in late:
            servers.stop()


def test_all_servers_killed_gives_the_clear_error(start_vllm: Any) -> None:
    """All servers SIGKILLed mid-run: after all_down_timeout the call raises, naming the
    servers, with every completed Response in the error."""
    servers = start_vllm(2)
    with VLLMQueueAnnotator(servers.base_urls, batch_size=64, all_down_timeout=5.0) as pool:

        def kill_all() -> None:
            for server in servers:
                server.kill()

        # Long enough that the kill (at a third of N) lands well before the end: a run
        # of N alone can finish while the servers are being killed.
        n = 6 * N
        Watch(pool, N // 3, kill_all, servers.base_urls[0])
        with pytest.raises(PoolExhaustedError) as info:
            pool.batch_generate(messages=conversations(n), options=OPTIONS)
        completed = pool.statistics().completed
    error = info.value
    for url in servers.base_urls:
        assert url in str(error)
    done = [r for r in error.responses if r is not None]
    assert len(error.responses) == n
    assert n > len(done) == completed >= N // 3
    assert all(r.ok for r in done)


def test_over_long_prompts_fail_alone(vllm_servers: LocalServers) -> None:
    """Over-long prompts are error rows for exactly those samples, and evict nobody."""
    batch = conversations(300)
    long_ones = set(range(7, 300, 50))
    for i in long_ones:
        batch[i] = [{"role": "user", "content": "word " * 2000}]
    with VLLMQueueAnnotator(vllm_servers.base_urls, batch_size=64, on_error="ignore") as pool:
        responses = pool.batch_generate(messages=batch, options=OPTIONS)
        stats = pool.statistics()
    assert {i for i, r in enumerate(responses) if not r.ok} == long_ones
    assert {r.error_type for r in responses if not r.ok} == {"bad_request"}
    assert stats.evictions == 0
