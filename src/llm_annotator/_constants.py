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
