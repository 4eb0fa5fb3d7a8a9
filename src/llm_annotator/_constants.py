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
"""Default seconds a health probe may take."""

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
"""The largest answer a client reads, per request: 16 MiB. A chat completion stays far
under it (even 32k tokens of output with top-20 logprobs is a few MiB of JSON), while a
proxy's error page streamed without end, a wrong endpoint sending a file, or a broken
server that never stops is cut off before one request costs the process real memory.
Answers are read in pieces and never buffered past the cap."""
