"""What the pool needs of a member's client: the consumer's statement of its contract.

:class:`~llm_annotator.clients.vllm_online_client.VLLMOnlineClient` is the one client
the pool builds; this protocol names exactly what the pool calls on it, and it is the
only gate for a client given to the pool (:func:`lacks` says what one is missing). So a
change inside the client that keeps these is safe for the pool, and a test's fake needs
these and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from llm_annotator._constants import HEALTH_TIMEOUT

if TYPE_CHECKING:
    from llm_annotator.clients.base import Messages
    from llm_annotator.clients.metrics import EngineLoad
    from llm_annotator.errors import ProviderError
    from llm_annotator.response import Response


@runtime_checkable
class MemberClient(Protocol):
    """One server's client, as a pool member uses it.

    ``isinstance(client, MemberClient)`` checks that ``client`` has every name below
    (not their signatures: mypy checks those).
    """

    base_url: str
    model: str | None
    """The model it asks for, read as ``member.model``; when it was not given, the pool
    sets it once from ``/v1/models`` (``Member.note_model``)."""
    provider: str

    def encode_params(self, options: Any = None, gen_kwargs: dict[str, Any] | None = None) -> bytes:
        """A call's generation parameters, encoded once for every request."""
        ...

    async def asend(self, messages: Messages, params: bytes) -> Response | ProviderError:
        """One request; a failure is returned, never raised."""
        ...

    async def acheck_health(self, timeout: float = HEALTH_TIMEOUT) -> ProviderError | None:
        """``/health``: None if healthy, else why not."""
        ...

    async def ais_healthy(self, timeout: float = HEALTH_TIMEOUT) -> bool:
        """Whether ``/health`` answers."""
        ...

    async def alist_models(self) -> list[str]:
        """The models ``/v1/models`` lists."""
        ...

    async def aengine_progress(self, timeout: float = HEALTH_TIMEOUT) -> float | None:
        """A sum of the engine's token counters (it grows while the engine works)."""
        ...

    async def aengine_load(self, timeout: float = HEALTH_TIMEOUT) -> EngineLoad | None:
        """The engine's gauges from ``/metrics``."""
        ...

    def redact(self, error: ProviderError) -> ProviderError:
        """``error`` with the API key cut out of its message."""
        ...

    async def aclose(self) -> None:
        """Close the connections."""
        ...


MEMBER_CLIENT_NAMES = tuple(
    dict.fromkeys(
        [
            *MemberClient.__annotations__,
            *(
                name
                for name, value in vars(MemberClient).items()
                if callable(value) and not name.startswith("_")
            ),
        ]
    )
)
"""The names :class:`MemberClient` lists (its attributes, then its methods)."""


def lacks(client: object) -> list[str]:
    """The names of :class:`MemberClient` that ``client`` does not have (none for a
    client the pool can use).

    Examples:
        >>> len(MEMBER_CLIENT_NAMES), lacks(object())[:3]
        (12, ['base_url', 'model', 'provider'])
    """
    return [name for name in MEMBER_CLIENT_NAMES if not hasattr(client, name)]
