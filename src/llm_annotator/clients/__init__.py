"""Clients: one model server (or in-process engine) each, with a sync and an async API."""

from llm_annotator.clients.base import Client, ProviderRuntimeOptions
from llm_annotator.clients.openai_client import OpenAIClient

__all__ = ["Client", "OpenAIClient", "ProviderRuntimeOptions"]
