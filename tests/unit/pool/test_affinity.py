"""Prefix affinity: a group's samples go to one member while it has room, new groups to
whoever is free, and no member idles while work waits.

The queue's rules are tested on the queue alone; the pool's use of them runs on the fake
clock, with servers that answer a sample of a group they have seen (its prefix cached)
faster than one they have not. ``benchmarks/prefix_affinity.py`` measures it on real
vLLM servers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from llm_annotator import ErrorKind, Response, VLLMQueueAnnotator
from llm_annotator.clients.metrics import EngineLoad
from llm_annotator.errors import ServerConnectError
from llm_annotator.pool import dispatch
from llm_annotator.pool.affinity import MIN_LOAD, GroupQueue, load_bound
from tests.unit.fake_clock import FakeClock
from tests.unit.pool.test_windows import LineClient

OPEN = dict.fromkeys(range(10_000))
"""Every sample open."""


def queue_of(groups: Sequence[str | None], members: int = 2) -> GroupQueue:
    queue = GroupQueue(lambda: members)
    for index, group in enumerate(groups):
        queue.push(index, group)
    return queue


# -- the queue alone ------------------------------------------------------------------


def test_a_member_takes_a_new_group_whole_and_later_samples_of_it_follow() -> None:
    queue = queue_of(["d1", "d2", "d1", "d3", "d2", "d1"])
    assert queue.take("a", 2, OPEN, None) == [0, 2]  # d1's first two, together
    assert queue.take("b", 2, OPEN, None) == [1, 4]  # d2: a new group, b's now
    queue.push(6, "d2")  # b holds d2: its next sample waits for b
    queue.push(7, "d1")
    assert queue.take("a", 3, OPEN, None) == [5, 7, 3]  # its own d1 first, then new d3
    assert queue.take("b", 8, OPEN, None) == [6]
    assert len(queue) == 0


def test_samples_without_a_group_are_taken_in_order_by_whoever_is_free() -> None:
    queue = queue_of([None] * 6)
    assert queue.take("a", 2, OPEN, None) == [0, 1]
    assert queue.take("b", 2, OPEN, None) == [2, 3]
    assert queue.take("a", 9, OPEN, None) == [4, 5]


def test_an_idle_member_takes_from_the_member_that_holds_most() -> None:
    """Nothing new is left: b takes a's groups (whole, the ones a would reach last)
    rather than idle."""
    queue = queue_of(["d1", "d2", "d3"])
    assert queue.take("a", 3, OPEN, None) == [0, 1, 2]
    for index, group in enumerate(["d1", "d1", "d2", "d2", "d3"], start=3):
        queue.push(index, group)
    assert queue.held() == {"a": 5}
    assert queue.take("b", 2, OPEN, None) == [7, 5]  # d3, then d2: b's now
    queue.push(8, "d2")
    assert queue.take("a", 2, OPEN, None) == [3, 4]
    assert queue.take("b", 9, OPEN, None) == [6, 8]


def test_a_remembered_home_takes_its_group_only_within_the_load_bound() -> None:
    """a is home to many groups; once it holds the bound, a group it was home to goes
    to whoever is free."""
    groups = [f"g{i}" for i in range(2 * MIN_LOAD)]
    queue = queue_of(groups)
    assert len(queue.take("a", len(groups), OPEN, None) or []) == len(groups)  # a homes all
    for index, group in enumerate(groups, start=len(groups)):
        queue.push(index, group)  # each returns to a, up to the bound
    held = queue.held()["a"]
    assert MIN_LOAD <= held <= load_bound(len(queue), 2) < len(groups)
    assert len(queue.take("b", len(groups) - held, OPEN, None)) == len(groups) - held
    assert queue.held() == {"a": held}  # b took the groups a had no room for


def test_a_member_that_stops_hands_its_groups_to_the_others() -> None:
    queue = queue_of(["d1", "d2"])
    assert queue.take("a", 2, OPEN, None) == [0, 1]
    queue.push(2, "d1")
    queue.push(3, "d2")
    queue.release("a")  # evicted
    assert queue.held() == {}
    assert queue.take("b", 1, OPEN, None) == [2]
    queue.push(4, "d1")  # d1 is b's now
    assert queue.take("b", 9, OPEN, None) == [4, 3]


def test_closed_and_avoided_samples_are_skipped_or_left_for_another_member() -> None:
    queue = queue_of(["d1", "d1", "d1"])
    open_ = {0: None, 2: None}  # 1 was answered meanwhile (a hedge)
    assert queue.take("a", 9, open_, lambda index: index == 2) == [0]
    assert len(queue) == 1
    assert queue.take("b", 9, open_, None) == [2]


def test_requeued_samples_go_first() -> None:
    queue = queue_of(["d1", "d2", "d3"])
    assert queue.take("a", 1, OPEN, None) == [0]
    queue.push_front([0])
    assert queue.take("b", 2, OPEN, None) == [0, 1]


def test_the_load_bound_is_an_even_share_times_the_bound() -> None:
    assert load_bound(10_000, 4) == 3125
    assert load_bound(10_000, 4, bound=1.0) == 2500
    assert load_bound(0, 3) == MIN_LOAD


# -- the pool on the fake clock ---------------------------------------------------------


class CachingClient(LineClient):
    """A server with a prefix cache: a sample of a group whose prefix it has computed
    (a request of the group started before) takes ``hit`` fake seconds, else
    ``miss``; it records what it answered."""

    def __init__(self, url: str, clock: FakeClock, *, hit: float, miss: float) -> None:
        super().__init__(url, clock, capacity=16, service=hit)
        self.hit, self.miss = hit, miss
        self.seen: set[str] = set()
        self.groups: Counter[str] = Counter()
        self.first_prompts: list[str] = []
        self.dead_at = float("inf")

    async def asend(self, messages: Any, params: bytes) -> Response | Any:
        if self.clock.now() >= self.dead_at:
            await self.clock.sleep(0.01)
            return ServerConnectError(
                "connect timed out", kind=ErrorKind.CONNECT_TIMEOUT, server=self.base_url
            )
        prompt = messages[-1]["content"]
        if len(self.first_prompts) < 3:
            self.first_prompts.append(prompt)
        group = prompt.split("|")[0]
        self.holding += 1
        self.held.append((self.clock.now(), self.holding))
        try:
            async with self.line:
                cached = group in self.seen
                self.seen.add(group)
                await self.clock.sleep(self.hit if cached else self.miss)
        finally:
            self.holding -= 1
        self.answers += 1
        if prompt != "warm":
            self.groups[group] += 1
        return Response(text=prompt, finish_reason="stop", server=self.base_url)

    async def acheck_health(self, timeout: float = 5.0) -> Any:
        if self.clock.now() >= self.dead_at:
            await self.clock.sleep(timeout)
            return ServerConnectError("down", kind=ErrorKind.CONNECT_TIMEOUT, server=self.base_url)
        return await super().acheck_health(timeout)


def shuffled_questions(documents: int, questions: int) -> list[tuple[int, str]]:
    """``documents x questions`` (key, prompt) pairs, a document's questions spread out."""
    prompts = [f"doc{d}|q{q}" for q in range(questions) for d in range(documents)]
    return list(enumerate(prompts))


async def annotate(
    pool: VLLMQueueAnnotator, pairs: list[tuple[int, str]], warmup: str | None = None
) -> dict[int, str]:
    prompts = dict(pairs)

    async def source() -> AsyncIterator[tuple[int, list[dict[str, str]]]]:
        for key, prompt in pairs:
            yield key, [{"role": "user", "content": prompt}]

    answers: dict[int, str] = {}
    async for key, response in pool.astream(
        source(),
        group=lambda key: prompts[key].split("|")[0],
        warmup=None if warmup is None else [{"role": "user", "content": warmup}],
    ):
        assert response.ok, response.error
        assert key not in answers
        answers[key] = response.text or ""
    return answers


def run_pool(
    clients: list[CachingClient],
    clock: FakeClock,
    pairs: list[tuple[int, str]],
    affinity: bool,
    warmup: str | None = None,
) -> dict[int, str]:
    async def scenario() -> dict[int, str]:
        async with VLLMQueueAnnotator(
            clients=clients,
            clock=clock,
            batch_size=16,
            max_concurrent_batches_per_client=2,
            hedge_tail=False,
            prefix_affinity=affinity,
        ) as pool:
            return await annotate(pool, pairs, warmup)

    return asyncio.run(scenario())


def test_each_group_stays_on_one_member_and_the_call_is_faster_for_it() -> None:
    """200 documents of 5 questions, a document's questions far apart: with affinity a
    document is mostly answered by one server (its prefix computed once; a member
    with nothing of its own left takes another's group, so a few are on both),
    without it nearly every document lands on both."""
    pairs = shuffled_questions(200, 5)
    times = {}
    spread = {}
    for affinity in (False, True):
        clock = FakeClock()
        servers = [CachingClient(f"http://s{i}:1/v1", clock, hit=0.02, miss=0.1) for i in range(2)]
        answers = run_pool(servers, clock, pairs, affinity)
        assert answers == dict(pairs)  # every sample once, its own answer
        times[affinity] = clock.now()
        spread[affinity] = sum(len(s.groups) for s in servers)
    assert spread[True] <= 300, spread
    assert spread[False] >= 380, spread
    assert times[True] < 0.8 * times[False], times


def test_work_spreads_over_every_member_by_the_load_bound() -> None:
    """One server would take every new document it meets first; the others take new ones
    as they are free, so each ends with about its share."""
    pairs = shuffled_questions(300, 3)
    clock = FakeClock()
    servers = [CachingClient(f"http://s{i}:1/v1", clock, hit=0.02, miss=0.1) for i in range(3)]
    run_pool(servers, clock, pairs, affinity=True)
    loads = [sum(s.groups.values()) for s in servers]
    assert sum(loads) == 900
    assert max(loads) <= 1.25 * 900 / 3, loads


def test_an_evicted_members_groups_go_to_the_others() -> None:
    clock = FakeClock()
    servers = [CachingClient(f"http://s{i}:1/v1", clock, hit=0.02, miss=0.1) for i in range(2)]
    servers[1].dead_at = 1.0
    pairs = shuffled_questions(200, 5)
    answers = run_pool(servers, clock, pairs, affinity=True)
    assert answers == dict(pairs)
    late = sum(servers[0].groups.values())
    assert late > 500  # the survivor answered its own and the dead member's groups


def test_each_member_answers_the_warm_up_before_its_first_sample() -> None:
    clock = FakeClock()
    servers = [CachingClient(f"http://s{i}:1/v1", clock, hit=0.02, miss=0.1) for i in range(2)]
    run_pool(servers, clock, shuffled_questions(20, 2), affinity=True, warmup="warm")
    for server in servers:
        assert server.first_prompts[0] == "warm"
        assert "warm" not in server.first_prompts[1:]


def test_a_warm_up_that_never_answers_holds_the_member_back_only_briefly() -> None:
    class Hung(CachingClient):
        async def asend(self, messages: Any, params: bytes) -> Response | Any:
            if messages[-1]["content"] == "warm":
                await self.clock.sleep(3600.0)
            return await super().asend(messages, params)

    clock = FakeClock()
    servers: list[CachingClient] = [
        Hung(f"http://s{i}:1/v1", clock, hit=0.02, miss=0.1) for i in range(2)
    ]
    answers = run_pool(servers, clock, shuffled_questions(20, 2), affinity=True, warmup="warm")
    assert len(answers) == 40
    assert clock.now() < dispatch.WARM_WAIT + 5
    assert all(sum(server.groups.values()) for server in servers)


def test_each_members_prefix_cache_hit_rate_is_in_the_statistics_of_its_first_stream() -> None:
    """The servers count 100 prompt tokens a request, 80 of them cached when the
    document was seen there before; the pool's statistics give what grew during the
    stream, from the first reading (taken as the stream starts) to the last."""

    class Counting(CachingClient):
        queries = hits = 0

        async def asend(self, messages: Any, params: bytes) -> Response | Any:
            self.queries += 100
            self.hits += 80 if messages[-1]["content"].split("|")[0] in self.seen else 0
            return await super().asend(messages, params)

        async def aengine_load(self, timeout: float = 5.0) -> EngineLoad | None:
            await self.clock.sleep(0.001)
            return EngineLoad(0, 0, prefix_cache_queries=self.queries, prefix_cache_hits=self.hits)

    clock = FakeClock()
    servers = [Counting(f"http://s{i}:1/v1", clock, hit=0.02, miss=0.1) for i in range(2)]
    stats = {}

    async def scenario() -> None:
        async with VLLMQueueAnnotator(clients=servers, clock=clock, prefix_affinity=True) as pool:
            await annotate(pool, shuffled_questions(50, 4))
            stats.update({m.server: m for m in pool.statistics().members})

    asyncio.run(scenario())
    for server in servers:
        member = stats[server.base_url]
        assert member.prefix_cache_queries == server.queries > 0
        assert member.prefix_cache_hits == server.hits
        assert member.prefix_cache_hit_rate == server.hits / server.queries


def test_without_affinity_groups_and_the_warm_up_are_ignored() -> None:
    clock = FakeClock()
    servers = [CachingClient(f"http://s{i}:1/v1", clock, hit=0.02, miss=0.1) for i in range(2)]
    run_pool(servers, clock, shuffled_questions(20, 2), affinity=False, warmup="warm")
    assert all(server.first_prompts[0] != "warm" for server in servers)


@pytest.mark.parametrize("affinity", [False, True])
def test_a_slow_server_still_holds_only_its_share_of_the_end(affinity: bool) -> None:
    """The makespan on servers of unequal speed is within 2% of the work-conserving
    bound with affinity as without: a stream of 50 groups on a server eight times
    slower than the other."""
    clock = FakeClock()
    fast = LineClient("http://fast:1/v1", clock, capacity=32, service=0.1)
    slow = LineClient("http://slow:1/v1", clock, capacity=4, service=0.1)
    samples = 3600
    bound = samples / (320 + 40)

    async def scenario() -> int:
        async with VLLMQueueAnnotator(
            clients=[fast, slow],
            clock=clock,
            batch_size=64,
            max_concurrent_batches_per_client=4,
            prefix_affinity=affinity,
        ) as pool:
            pairs = [(i, [{"role": "user", "content": f"sample {i}"}]) for i in range(samples)]
            done = 0
            async for _key, response in pool.astream(pairs, group=lambda key: key % 50):
                assert response.ok
                done += 1
            return done

    assert asyncio.run(scenario()) == samples
    assert clock.now() <= 1.02 * bound, (clock.now(), bound, fast.answers, slow.answers)
