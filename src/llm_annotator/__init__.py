"""llm_annotator: annotate datasets with LLMs over a pool of vLLM servers.

The public API lives here; everything else is an implementation module. The names are
imported when first used (PEP 562), so ``from llm_annotator import VLLMOnlineClient``
loads the client only, not the job layer's Arrow and NumPy.
"""

from typing import TYPE_CHECKING

from llm_annotator._lazy import lazy_names
from llm_annotator.errors import (
    ConfigurationError,
    DisconnectedError,
    DuplicateServerError,
    ErrorKind,
    FingerprintMismatchError,
    InputError,
    JobError,
    LLMAnnotatorError,
    MalformedResponseError,
    OutputWriteError,
    OversizedResponseError,
    PoolExhaustedError,
    PromptError,
    ProviderError,
    ReadTimeoutError,
    RunDirectoryError,
    RunInterruptedError,
    ServerConnectError,
    ServersUnusableError,
    StatusError,
    TLSError,
    TransportError,
)
from llm_annotator.response import OnError, Response

if TYPE_CHECKING:
    from llm_annotator.annotator import VLLMQueueAnnotator
    from llm_annotator.clients.base import Client, ProviderRuntimeOptions
    from llm_annotator.clients.openai_client import OpenAIClient
    from llm_annotator.clients.vllm_offline_client import (
        VLLMOfflineClient,
        VLLMOfflineRuntimeOptions,
    )
    from llm_annotator.clients.vllm_online_client import (
        MAX_CONNECTIONS,
        VLLMBaseRuntimeOptions,
        VLLMOnlineClient,
        VLLMOnlineRuntimeOptions,
        server_is_healthy,
    )
    from llm_annotator.jobs import AnnotationResult, Annotator, OutputSchema, PromptTemplate
    from llm_annotator.pipeline import Pipeline, Step
    from llm_annotator.pool import (
        DirectorySource,
        DnsSource,
        FileSource,
        MemberState,
        MemberStatistics,
        PoolStatistics,
        ServerDiscovery,
        ServerSource,
    )

_LAZY = {
    "Client": "llm_annotator.clients.base",
    "ProviderRuntimeOptions": "llm_annotator.clients.base",
    "OpenAIClient": "llm_annotator.clients.openai_client",
    "VLLMOfflineClient": "llm_annotator.clients.vllm_offline_client",
    "VLLMOfflineRuntimeOptions": "llm_annotator.clients.vllm_offline_client",
    "MAX_CONNECTIONS": "llm_annotator.clients.vllm_online_client",
    "VLLMBaseRuntimeOptions": "llm_annotator.clients.vllm_online_client",
    "VLLMOnlineClient": "llm_annotator.clients.vllm_online_client",
    "VLLMOnlineRuntimeOptions": "llm_annotator.clients.vllm_online_client",
    "server_is_healthy": "llm_annotator.clients.vllm_online_client",
    "AnnotationResult": "llm_annotator.jobs",
    "Annotator": "llm_annotator.jobs",
    "OutputSchema": "llm_annotator.jobs",
    "PromptTemplate": "llm_annotator.jobs",
    "DirectorySource": "llm_annotator.pool",
    "DnsSource": "llm_annotator.pool",
    "FileSource": "llm_annotator.pool",
    "MemberState": "llm_annotator.pool",
    "MemberStatistics": "llm_annotator.pool",
    "PoolStatistics": "llm_annotator.pool",
    "ServerDiscovery": "llm_annotator.pool",
    "ServerSource": "llm_annotator.pool",
    "VLLMQueueAnnotator": "llm_annotator.annotator",
    "Pipeline": "llm_annotator.pipeline",
    "Step": "llm_annotator.pipeline",
}
"""The public names imported on first use, and the module of each."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
del TYPE_CHECKING, lazy_names  # not public names

__version__ = "0.1.0"

__all__ = [
    "MAX_CONNECTIONS",
    "AnnotationResult",
    "Annotator",
    "Client",
    "ConfigurationError",
    "DirectorySource",
    "DisconnectedError",
    "DnsSource",
    "DuplicateServerError",
    "ErrorKind",
    "FileSource",
    "FingerprintMismatchError",
    "InputError",
    "JobError",
    "LLMAnnotatorError",
    "MalformedResponseError",
    "MemberState",
    "MemberStatistics",
    "OnError",
    "OpenAIClient",
    "OutputSchema",
    "OutputWriteError",
    "OversizedResponseError",
    "Pipeline",
    "PoolExhaustedError",
    "PoolStatistics",
    "PromptError",
    "PromptTemplate",
    "ProviderError",
    "ProviderRuntimeOptions",
    "ReadTimeoutError",
    "Response",
    "RunDirectoryError",
    "RunInterruptedError",
    "ServerConnectError",
    "ServerDiscovery",
    "ServerSource",
    "ServersUnusableError",
    "StatusError",
    "Step",
    "TLSError",
    "TransportError",
    "VLLMBaseRuntimeOptions",
    "VLLMOfflineClient",
    "VLLMOfflineRuntimeOptions",
    "VLLMOnlineClient",
    "VLLMOnlineRuntimeOptions",
    "VLLMQueueAnnotator",
    "__version__",
    "server_is_healthy",
]
