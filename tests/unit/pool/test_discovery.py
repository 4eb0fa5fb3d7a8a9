"""Live server discovery: the diff as a table, each source's parsing, and a real pool that
follows a servers file, a directory of URL files and a DNS name while a call runs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import structlog

from llm_annotator import VLLMQueueAnnotator
from llm_annotator.errors import ConfigurationError, DuplicateServerError
from llm_annotator.pool.discovery import (
    Changes,
    DirectorySource,
    DnsSource,
    FileSource,
    ServerDiscovery,
    parse_dns_target,
    plan_changes,
)
from tests.unit.conftest import FakeServer, running_fake_server
from tests.unit.helpers import FAST, conversations, delayed_echo, index_of

FakeServers = Callable[[int], list[FakeServer]]

A, B, C = "http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1", "http://10.0.0.3:8000/v1"


# -- the diff -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listed", "members", "owned", "withdrawn", "expected"),
    [
        # nothing changes
        ({A}, [A], {A}, set(), Changes(add=(), remove=(), waiting=())),
        # a new URL is added
        ({A, B}, [A], {A}, set(), Changes(add=(B,), remove=(), waiting=())),
        # a URL discovery added that no source lists is removed
        (set(), [A, B], {A, B}, set(), Changes(add=(), remove=(A, B), waiting=())),
        # a member given by hand is never removed
        (set(), [A, B], {B}, set(), Changes(add=(), remove=(B,), waiting=())),
        # a member given by hand that a source also lists is not added twice
        ({A}, [A], set(), set(), Changes(add=(), remove=(), waiting=())),
        # a draining member is not removed again
        (set(), [A], set(), {A}, Changes(add=(), remove=(), waiting=())),
        # a URL listed again while its member drains waits for it to leave
        ({A}, [A], set(), {A}, Changes(add=(), remove=(), waiting=(A,))),
        # once it has left, it is added again
        ({A}, [], set(), {A}, Changes(add=(A,), remove=(), waiting=())),
        # an owned URL the pool lost while still listed comes back
        ({A}, [], {A}, set(), Changes(add=(A,), remove=(), waiting=())),
        # additions are sorted; removals keep the pool's order
        ({C, A}, [B], {B}, set(), Changes(add=(A, C), remove=(B,), waiting=())),
    ],
)
def test_plan_changes(
    listed: set[str], members: list[str], owned: set[str], withdrawn: set[str], expected: Changes
) -> None:
    """Listed and not in the pool: add; owned and no longer listed: remove; hand-given
    members stay; a URL back while its member drains waits."""
    assert plan_changes(listed, members, owned, withdrawn) == expected


# -- the sources ----------------------------------------------------------------------


def test_file_source_parses_lines_and_skips_bad_ones_once(tmp_path: Path) -> None:
    """Blank lines and comments are ignored, URLs normalized and deduplicated; a line
    that is not a URL is skipped and logged once, not once per read."""
    path = tmp_path / "servers.txt"
    path.write_text(
        "# the pool\n\n"
        "http://10.0.0.1:8000/v1/\n"
        "  http://10.0.0.2:8000/v1   # node 2\n"
        "http://10.0.0.1:8000/v1\n"
        "10.0.0.9:8000\n"
    )
    source = FileSource(path)
    with structlog.testing.capture_logs() as logs:
        assert source.read_sync() == {A, B}
        assert source.read_sync() == {A, B}
    skipped = [e for e in logs if e["event"] == "discovery_entry_skipped"]
    assert [(e["line"], e["entry"]) for e in skipped] == [(6, "10.0.0.9:8000")]


async def test_file_source_reads_changes(tmp_path: Path) -> None:
    """An edited file is read again; a missing file raises OSError (the caller keeps
    the last list)."""
    path = tmp_path / "servers.txt"
    path.write_text(f"{A}\n")
    source = FileSource(path)
    assert await source.read() == {A}
    path.write_text(f"{A}\n{C}\n")
    assert await source.read() == {A, C}
    path.unlink()
    with pytest.raises(FileNotFoundError):
        await source.read()


def test_directory_source_reads_url_files(tmp_path: Path) -> None:
    """Only non-hidden ``*.url`` files count; an empty or half-written one is skipped
    and logged once; a known file being rewritten keeps its URL; a deleted one leaves."""
    (tmp_path / "a.url").write_text(f"  {A}\n")
    (tmp_path / "notes.txt").write_text(B)
    (tmp_path / ".b.url").write_text(B)
    (tmp_path / "b.url.tmp").write_text(B)
    (tmp_path / "dir.url").mkdir()
    (tmp_path / "c.url").write_text("")
    (tmp_path / "d.url").write_text("http:")
    source = DirectorySource(tmp_path)
    with structlog.testing.capture_logs() as logs:
        assert source.read_sync() == {A}
        assert source.read_sync() == {A}
    skipped = sorted(e["file"] for e in logs if e["event"] == "discovery_entry_skipped")
    assert skipped == ["c.url", "d.url"]

    (tmp_path / "c.url").write_text(C + "\n")
    (tmp_path / "a.url").write_text("")  # being rewritten
    assert source.read_sync() == {A, C}
    (tmp_path / "a.url").write_text(B)
    assert source.read_sync() == {B, C}
    (tmp_path / "a.url").unlink()
    assert source.read_sync() == {C}


async def test_directory_source_missing_directory_raises(tmp_path: Path) -> None:
    """A directory that does not exist is a failed read, not an empty list."""
    with pytest.raises(FileNotFoundError):
        await DirectorySource(tmp_path / "nowhere").read()


def addrinfo(*addresses: str, port: int = 8000) -> list[tuple[Any, ...]]:
    """What getaddrinfo answers for these addresses."""
    return [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, port, 0, 0))
        if ":" in a
        else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
        for a in addresses
    ]


async def test_dns_source_turns_addresses_into_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each address becomes a base URL on the given port, IPv6 in brackets, once each;
    the async read goes through the running loop's resolver."""
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        asked.append((host, port))
        return addrinfo("10.0.0.1", "10.0.0.2", "10.0.0.1", "fd00::7")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", resolve)
    source = DnsSource.parse("vllm.ns.svc.cluster.local:8000")
    assert await source.read() == {A, B, "http://[fd00::7]:8000/v1"}
    assert asked == [("vllm.ns.svc.cluster.local", 8000)]
    assert source.description == "dns vllm.ns.svc.cluster.local:8000"


async def test_dns_source_failure_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed resolution, or one without addresses, is a failed read."""
    answers: list[Any] = [socket.gaierror(socket.EAI_AGAIN, "temporary failure"), []]

    async def resolve(host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", resolve)
    source = DnsSource("vllm", 8000)
    with pytest.raises(socket.gaierror):
        await source.read()
    with pytest.raises(OSError, match="no IP address"):
        await source.read()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:8000", ("vllm", 8000)),
        (" vllm.ns.svc.cluster.local:80 ", ("vllm.ns.svc.cluster.local", 80)),
        ("10.0.0.1:65535", ("10.0.0.1", 65535)),
        ("[::1]:8000", ("::1", 8000)),
        ("vllm", None),
        ("vllm:", None),
        (":8000", None),
        ("vllm:0", None),
        ("vllm:65536", None),
        ("vllm:http", None),
        ("vllm:８０", None),
        ("vllm: 80", None),
        ("vllm:+80", None),
        ("vllm:8_000", None),
        ("http://vllm:8000", None),
        ("two words:8000", None),
        ("::1:8000", None),
        ("[vllm]:8000", None),
        ("-vllm:8000", None),
        ("", None),
    ],
)
def test_parse_dns_target(text: str, expected: tuple[str, int] | None) -> None:
    """``name:port`` splits into a host and a port; anything else names the expected form."""
    if expected is None:
        with pytest.raises(ConfigurationError, match="is not name:port"):
            parse_dns_target(text)
        with pytest.raises(ConfigurationError):
            DnsSource.parse(text)
    else:
        assert parse_dns_target(text) == expected
        assert DnsSource.parse(text) == DnsSource(*expected)


@pytest.mark.parametrize(
    "build",
    [
        lambda: DnsSource("two words", 80),
        lambda: DnsSource("vllm", 0),
        lambda: DnsSource("vllm", True),
        lambda: FileSource(""),  # type: ignore[arg-type]
        lambda: FileSource(3),  # type: ignore[arg-type]
        lambda: DirectorySource(None),  # type: ignore[arg-type]
        lambda: ServerDiscovery([]),
        lambda: ServerDiscovery([DnsSource("vllm", 80)], interval=0),
        lambda: ServerDiscovery([DnsSource("vllm", 80)], source_timeout=-1),
    ],
)
def test_bad_settings_raise(build: Callable[[], object]) -> None:
    """Sources and discovery refuse settings that cannot work."""
    with pytest.raises(ConfigurationError):
        build()


# -- rounds against a stand-in pool ---------------------------------------------------


class Listing:
    """A source whose list (or failure) the test sets."""

    description = "listing"

    def __init__(self, *urls: str) -> None:
        self.urls: set[str] | None = set(urls)
        self.error: Exception | None = None
        self.hang = False

    async def read(self) -> set[str] | None:
        if self.hang:
            await asyncio.sleep(3600)
        return self.read_sync()

    def read_sync(self) -> set[str] | None:
        if self.error is not None:
            raise self.error
        return None if self.urls is None else set(self.urls)


class Pool:
    """A pool stand-in: removed members drain until the test lets them leave."""

    def __init__(self, *urls: str) -> None:
        self.members = list(urls)
        self.draining: set[str] = set()

    @property
    def base_urls(self) -> list[str]:
        return list(self.members)

    def add_server(self, base_url: str) -> None:
        if base_url in self.members:
            raise DuplicateServerError(f"{base_url} is in the pool")
        self.members.append(base_url)

    def remove_server(self, base_url: str) -> None:
        if base_url not in self.members:
            raise KeyError(base_url)
        self.draining.add(base_url)

    def leave(self, base_url: str) -> None:
        self.members.remove(base_url)
        self.draining.discard(base_url)


async def test_hand_given_servers_stay_and_found_ones_come_and_go() -> None:
    """A listed URL is added and removed when delisted; the pool's own member stays."""
    listing = Listing(B)
    discovery = ServerDiscovery([listing])
    pool = Pool(A)
    with structlog.testing.capture_logs() as logs:
        assert await discovery.refresh(pool) == ([B], [])
        listing.urls = set()
        assert await discovery.refresh(pool) == ([], [B])
        assert await discovery.refresh(pool) == ([], [])  # draining: not removed twice
    assert pool.draining == {B}
    events = [(e["event"], e.get("server")) for e in logs]
    assert ("server_discovered", B) in events
    assert ("server_withdrawn", B) in events
    assert ("server_withdrawn", A) not in events


async def test_url_back_while_draining_joins_after_it_left() -> None:
    """A URL listed again while its old member drains is added once that member left."""
    listing = Listing(A)
    discovery = ServerDiscovery([listing])
    pool = Pool()
    await discovery.refresh(pool)
    listing.urls = set()
    assert await discovery.refresh(pool) == ([], [A])
    listing.urls = {A}
    assert await discovery.refresh(pool) == ([], [])
    pool.leave(A)
    assert await discovery.refresh(pool) == ([A], [])
    listing.urls = set()
    assert await discovery.refresh(pool) == ([], [A])  # and it is ours again


async def test_initial_urls_are_owned_and_removed_when_delisted() -> None:
    """URLs from initial_urls built the pool; they leave when no source lists them."""
    listing = Listing(B, A)
    discovery = ServerDiscovery([listing, Listing(A)])
    urls = discovery.initial_urls()
    assert urls == [A, B]
    pool = Pool(*urls)
    listing.urls = set()
    assert await discovery.refresh(pool) == ([], [B])  # the other source lists A


async def test_failed_source_keeps_its_list_and_logs_once() -> None:
    """A source that fails keeps its last list; the failure is logged once, the
    recovery too; a None answer keeps the list silently."""
    listing = Listing(A, B)
    discovery = ServerDiscovery([listing])
    pool = Pool()
    await discovery.refresh(pool)
    listing.error = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert await discovery.refresh(pool) == ([], [])
        listing.error, listing.urls = None, None
        assert await discovery.refresh(pool) == ([], [])
        listing.urls = {A}
        assert await discovery.refresh(pool) == ([], [B])
    events = [e["event"] for e in logs]
    assert events.count("discovery_source_failed") == 1
    assert events.count("discovery_source_recovered") == 1
    failed = next(e for e in logs if e["event"] == "discovery_source_failed")
    assert failed["log_level"] == "warning"
    assert failed["keeping"] == 2


async def test_hung_source_times_out_and_others_still_count() -> None:
    """A source that does not answer within source_timeout fails this round only."""
    hung, steady = Listing(A), Listing(B)
    hung.hang = True
    discovery = ServerDiscovery([hung, steady], source_timeout=0.05)
    with structlog.testing.capture_logs() as logs:
        added, _ = await asyncio.wait_for(discovery.refresh(Pool()), 5)
    assert added == [B]
    assert [e["error"] for e in logs if e["event"] == "discovery_source_failed"] == ["TimeoutError"]


async def test_run_survives_failing_rounds_and_stops() -> None:
    """run() logs a round that fails and goes on; it returns once stop is set."""

    class Broken(Pool):
        def add_server(self, base_url: str) -> None:
            raise RuntimeError("pool closed")

    discovery = ServerDiscovery([Listing(A)], interval=0.01)
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(discovery.run(Broken(), stop))
        await until(lambda: sum(e["event"] == "discovery_round_failed" for e in logs) >= 2)
        stop.set()
        await asyncio.wait_for(task, 5)
    assert "RuntimeError: pool closed" in logs[0]["error"]


# -- a real pool, while a call runs ---------------------------------------------------


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``predicate()`` holds, for about ``timeout`` seconds at most."""
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"still false after {timeout:g} s")


@contextlib.asynccontextmanager
async def discovering(discovery: ServerDiscovery, pool: VLLMQueueAnnotator) -> AsyncIterator[None]:
    """Run discovery beside the body; stop it after."""
    stop = asyncio.Event()
    task = asyncio.create_task(discovery.run(pool, stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


@contextlib.asynccontextmanager
async def calling(pool: VLLMQueueAnnotator, n: int) -> AsyncIterator[asyncio.Task[Any]]:
    """A call of ``n`` samples running as a task; cancelled if the body fails."""
    call = asyncio.create_task(pool.abatch_generate(messages=conversations(n)))
    try:
        yield call
    finally:
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)


def pool_for(urls: list[str]) -> VLLMQueueAnnotator:
    """A pool without tail hedging, so "each sample sent once" holds exactly."""
    return VLLMQueueAnnotator(
        urls, batch_size=5, max_concurrent_batches_per_client=1, hedge_tail=False, **FAST
    )


def assert_each_sample_sent_once_and_answered(
    responses: list[Any], servers: list[FakeServer], n: int
) -> None:
    assert [r.text for r in responses] == [f"sample {i}" for i in range(n)]
    sent = Counter(index_of(r) for s in servers for r in s.requests)
    assert sent == Counter(range(n))  # no request cancelled and sent again


async def test_servers_file_edited_mid_run_adds_a_server(
    fake_servers: FakeServers, tmp_path: Path
) -> None:
    """A URL written into the servers file during a call joins and answers samples."""
    first, second = fake_servers(2)
    first.handler = second.handler = delayed_echo(0.04)
    path = tmp_path / "servers.txt"
    path.write_text(f"# servers\n{first.base_url}\n")
    discovery = ServerDiscovery([FileSource(path)], interval=0.05)
    n = 300
    async with (
        pool_for(discovery.initial_urls()) as pool,
        discovering(discovery, pool),
        calling(pool, n) as call,
    ):
        await until(lambda: len(first.requests) >= 10)
        path.write_text(f"# servers\n{first.base_url}\n{second.base_url}\n")
        responses = await asyncio.wait_for(call, 30)
        assert pool.base_urls == [first.base_url, second.base_url]
    assert_each_sample_sent_once_and_answered(responses, [first, second], n)
    answered = Counter(r.server for r in responses)
    assert answered[second.base_url] > 0
    assert answered[first.base_url] + answered[second.base_url] == n


async def test_url_files_join_and_leave_without_losing_samples(
    fake_servers: FakeServers, tmp_path: Path
) -> None:
    """A URL file written late joins its server; deleting a URL file drains that member:
    it finishes what it holds, no sample is lost or sent twice, and it leaves."""
    first, second = fake_servers(2)
    first.handler = second.handler = delayed_echo(0.04)
    (tmp_path / "first.url").write_text(first.base_url + "\n")
    discovery = ServerDiscovery([DirectorySource(tmp_path)], interval=0.05)
    n = 300
    async with (
        pool_for(discovery.initial_urls()) as pool,
        discovering(discovery, pool),
        calling(pool, n) as call,
    ):
        await until(lambda: len(first.requests) >= 10)
        (tmp_path / "second.url").write_text(second.base_url + "\n")
        await until(lambda: len(second.requests) >= 10)
        (tmp_path / "first.url").unlink()
        await until(lambda: pool.base_urls == [second.base_url])
        assert not call.done()  # it left during the call, by draining
        responses = await asyncio.wait_for(call, 30)
    assert_each_sample_sent_once_and_answered(responses, [first, second], n)
    by_first = {index_of(r) for r in first.requests}
    assert by_first
    assert all(responses[i].server == first.base_url for i in by_first)  # it finished them
    assert first.in_flight == 0


def completed_by(pool: VLLMQueueAnnotator, url: str) -> int:
    """Samples the member with this URL completed so far (0 before it is a member)."""
    for member in pool.statistics().members:
        if member.server == url:
            return member.completed
    return 0


@pytest.fixture
def neighbour(fake_server: FakeServer) -> Iterator[FakeServer]:
    """A second fake server on ``fake_server``'s port at another loopback address (all
    of 127/8 is loopback on Linux): two addresses of one name."""
    port = urlsplit(fake_server.base_url).port
    assert port is not None
    with running_fake_server("127.0.0.2", port) as server:
        yield server


async def test_dns_name_follows_its_addresses_and_survives_failures(
    fake_server: FakeServer, neighbour: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Servers behind a DNS name join as addresses appear and drain as they go; a failed
    resolution keeps the servers known (logged once)."""
    port = urlsplit(fake_server.base_url).port
    second = neighbour.base_url
    fake_server.handler = neighbour.handler = delayed_echo(0.04)
    real_getaddrinfo = socket.getaddrinfo
    answer: dict[str, Any] = {"addresses": ["127.0.0.1"], "error": None, "calls": 0}

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        if host != "vllm.test":
            return real_getaddrinfo(host, port, *args, **kwargs)
        answer["calls"] += 1
        if answer["error"] is not None:
            raise answer["error"]
        return addrinfo(*answer["addresses"], port=port)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)  # under the loop's getaddrinfo too
    discovery = ServerDiscovery([DnsSource.parse(f"vllm.test:{port}")], interval=0.05)
    n = 300
    with structlog.testing.capture_logs() as logs:
        urls = discovery.initial_urls()
        assert urls == [fake_server.base_url]
        async with pool_for(urls) as pool, discovering(discovery, pool), calling(pool, n) as call:
            await until(lambda: len(fake_server.requests) >= 10)
            answer["addresses"] = ["127.0.0.1", "127.0.0.2"]
            await until(lambda: completed_by(pool, second) >= 10)

            answer["error"] = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
            failed_from = answer["calls"]
            await until(lambda: answer["calls"] >= failed_from + 3)
            assert pool.base_urls == [fake_server.base_url, second]

            answer["error"], answer["addresses"] = None, ["127.0.0.1"]
            await until(lambda: pool.base_urls == [fake_server.base_url])
            assert not call.done()
            responses = await asyncio.wait_for(call, 30)
    assert_each_sample_sent_once_and_answered(responses, [fake_server, neighbour], n)
    assert Counter(r.server for r in responses)[second] >= 10
    events = [e["event"] for e in logs]
    assert events.count("discovery_source_failed") == 1
    assert [e["server"] for e in logs if e["event"] == "server_withdrawn"] == [second]


def test_a_pool_built_on_discovery_alone_waits_for_its_first_server(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A pool whose only source is an empty servers folder waits; once a server writes
    its URL file, the call (the pool's own discovery, no task of the caller's) finishes
    on it."""
    folder = tmp_path / "servers"
    folder.mkdir()
    discovery = ServerDiscovery([DirectorySource(folder)], interval=0.05)
    pool = VLLMQueueAnnotator(discovery=discovery, all_down_timeout=30, **FAST)
    assert pool.base_urls == []

    async def scenario() -> list[Any]:
        async def announce() -> None:
            await asyncio.sleep(0.3)
            (folder / "a.url").write_text(fake_server.base_url + "\n", encoding="utf-8")

        writer = asyncio.ensure_future(announce())
        try:
            return await asyncio.wait_for(pool.abatch_generate(messages=conversations(40)), 20)
        finally:
            writer.cancel()
            await pool.aclose()

    responses = asyncio.run(scenario())
    assert [r.text for r in responses] == [f"sample {i}" for i in range(40)]
    assert {r.server for r in responses} == {fake_server.base_url}


SECRET = "sk-discovered-0123456789"
SLASHED = "12/ab+cd=="  # a base64 key, unescaped in a URL
HASHED = "p#ss?w/rd"


def test_a_key_with_slash_hash_or_question_mark_is_masked_whole(tmp_path: Path) -> None:
    """A password written unescaped in a URL may hold ``/``, ``#`` or ``?``: the entry
    is still refused for its credentials and logged with all of the key masked (a
    ``#`` inside an entry starts no comment)."""
    path = tmp_path / "servers.txt"
    path.write_text(
        f"{A}  # the first server\nhttp://admin:{SLASHED}@10.0.0.7:8000/v1\n"
        f"http://admin:{HASHED}@10.0.0.8:8000/v1\n# http://10.0.0.9:8000/v1\n"
    )
    with structlog.testing.capture_logs() as logs:
        assert FileSource(path).read_sync() == {A}
    skipped = [e for e in logs if e["event"] == "discovery_entry_skipped"]
    assert [e["entry"] for e in skipped] == [
        "http://***@10.0.0.7:8000/v1",
        "http://***@10.0.0.8:8000/v1",
    ]
    assert all(e["reason"].startswith("holds a user name or password") for e in skipped)
    for part in ("ab+cd", "p#ss", "w/rd", ":p"):
        assert part not in repr(logs), part


def test_a_credentialed_entry_is_skipped_for_its_credentials_and_logged_masked(
    tmp_path: Path,
) -> None:
    """A servers file line or a ``*.url`` file holding a URL with a user name and a
    key is no server: skipped with the reason that it holds credentials, and no log
    line carries the key (with or without a scheme)."""
    path = tmp_path / "servers.txt"
    path.write_text(
        f"{A}\nhttp://annotator:{SECRET}@10.0.0.7:8000/v1\nannotator:{SECRET}@10.0.0.8:8000\n"
    )
    folder = tmp_path / "urls"
    folder.mkdir()
    (folder / "a.url").write_text(f"{A}\n")
    (folder / "b.url").write_text(f"https://{SECRET}@10.0.0.9:8000/v1\n")
    with structlog.testing.capture_logs() as logs:
        assert FileSource(path).read_sync() == {A}
        assert DirectorySource(folder).read_sync() == {A}
    skipped = [e for e in logs if e["event"] == "discovery_entry_skipped"]
    assert len(skipped) == 3
    assert all(e["reason"].startswith("holds a user name or password") for e in skipped)
    assert [e["entry"] for e in skipped] == [
        "http://***@10.0.0.7:8000/v1",
        "***@10.0.0.8:8000",
        "https://***@10.0.0.9:8000/v1",
    ]
    assert SECRET not in repr(logs)


@pytest.mark.parametrize(
    "url",
    [
        f"http://annotator:{SECRET}@127.0.0.1:8000/v1",
        f"annotator:{SECRET}@127.0.0.1:8000",
        f"ftp://{SECRET}@127.0.0.1:8000",
        f"http://u:{SLASHED}@127.0.0.1:8000/v1",  # urlsplit reads host "u", port 12
        f"http://u:{HASHED}@127.0.0.1:8000/v1",
    ],
)
def test_a_credentialed_url_given_by_hand_is_refused_without_showing_the_key(url: str) -> None:
    with pytest.raises(ConfigurationError, match="holds credentials") as info:
        VLLMQueueAnnotator([url])
    for key in (SECRET, SLASHED, HASHED, "ab+cd", "w/rd"):
        assert key not in str(info.value)
