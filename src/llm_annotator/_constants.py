"""Defaults, named once."""

from __future__ import annotations

MAX_CONNECTIONS = 8192
"""Sockets one client may hold open to its server at once."""

CONNECT_TIMEOUT = 5.0
"""Seconds to establish a TCP connection. Short on purpose: a host that drops packets
must fail fast so a pool can evict it, while a loaded but live server still accepts
connections within milliseconds."""

KEEPALIVE_TIMEOUT = 4.0
"""Seconds an idle connection is kept for reuse. vLLM closes idle keep-alive
connections after 5 s; reusing one just as the server closes it would fail a request
that never reached the server, so we let go first."""

RETRY_INITIAL_DELAY = 0.5
RETRY_MAX_DELAY = 8.0
"""Exponential backoff between retries of one request: 0.5 s doubling to 8 s."""

HEALTH_TIMEOUT = 5.0
"""Default seconds a one-off health check (``is_healthy``) may take."""

TIMEOUT = 3600.0
"""Seconds one request to a vLLM server may take, answer included: a loaded server may
hold thousands of prompts in its queue."""

OPENAI_TIMEOUT = 600.0
"""The same for :class:`~llm_annotator.OpenAIClient`, as the OpenAI SDK's default."""

MAX_RETRIES = 2
"""Retries of one request by a client on its own (a pool sets 0: it is the retry layer)."""

BATCH_SIZE = 256
"""Samples per batch."""

MAX_CONCURRENT_BATCHES = 4
"""Batches in flight per server."""

HEALTH_CHECK_INTERVAL = 3.0
"""Seconds between the starts of two probes of a pool member."""

HEALTH_CHECK_TIMEOUT = 4.0
"""Seconds a pool's probe may take. Kept under 5 s, where aiohttp starts rounding
timeouts up to whole seconds."""

MAX_FAILED_HEALTH_CHECKS = 3
"""Failed probes in a row that evict a healthy member (about 15 s with the defaults)."""

MAX_SAMPLE_EVICTIONS = 3
"""Evictions a sample may live through before it is a poison sample."""

MAX_SAMPLE_RETRIES = 2
"""Retries of a sample after transient server errors."""

ALL_DOWN_TIMEOUT = 300.0
"""Seconds a pool waits for a server when every one is down."""

STOP_GRACE = 30.0
"""Seconds the requests in flight get after SIGINT or SIGTERM before a job stops."""

MAX_REGENERATIONS = 2
"""Times an answer that is invalid against the output schema is generated again."""

FLUSH_INTERVAL = 0.5
"""Seconds between two flushes of a job's results to its shard."""

SYNC_INTERVAL = 5.0
"""Seconds between two fsyncs of a job's shard."""

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
"""The largest answer a client reads, per request: 16 MiB. A chat completion stays far
under it (even 32k tokens of output with top-20 logprobs is a few MiB of JSON), while a
proxy's error page streamed without end, a wrong endpoint sending a file, or a broken
server that never stops is cut off before one request costs the process real memory.
Answers are read in pieces and never buffered past the cap."""

MAX_SERVER_FAULTS = 3
"""Answers in a row that are the server's fault (garbage, a 5xx, a cut-off body, a hung
request) that evict a pool member. Three, not one: a live server may drop one keep-alive
connection at the wrong moment, and a second failure may already be in flight; not
twenty: a member answering garbage spoils a few of its samples' first tries before it
goes, and each of those is sent again elsewhere."""

MAX_OVERLOAD_REQUEUES = 50
"""Overload answers (429, 503) one sample may get before it becomes an error row: enough
to outlast the backoff of a busy pool for minutes, few enough that a sample every server
refuses ends."""

STALL_WINDOW = 30.0
"""The least time a pool member may hold requests and answer none before it is taken
for hung (its ``/health`` may still say 200). The window grows with the longest gap
between answers the member (or, before its first answer, the pool) has shown: three
times that gap. 30 s is three times the longest stall of a live server seen here
(10 s of no tokens with badly bound threads)."""

STALL_FACTOR = 3.0
"""How many times its longest gap between answers a member may go quiet."""

CANARY_TIMEOUT = 30.0
"""Seconds the one-token test completion that re-admits an evicted member may take."""

MAX_PROBATION = 300.0
"""The longest wait before an evicted member is tried again; the wait doubles with each
eviction and each failed test completion, from ``health_check_interval``."""
