"""Clients: one model server (or in-process engine) each, with a sync and an async API.

The names are imported when first used (PEP 562): importing this package loads no
client module.
"""

from typing import TYPE_CHECKING

from llm_annotator._lazy import lazy_names

if TYPE_CHECKING:
    from llm_annotator.clients.base import Client, ProviderRuntimeOptions
    from llm_annotator.clients.openai_client import OpenAIClient

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "Client": "llm_annotator.clients.base",
        "ProviderRuntimeOptions": "llm_annotator.clients.base",
        "OpenAIClient": "llm_annotator.clients.openai_client",
    },
)

__all__ = ["Client", "OpenAIClient", "ProviderRuntimeOptions"]
