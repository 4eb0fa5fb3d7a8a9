"""llm_annotator: annotate datasets with LLMs over a pool of vLLM servers.

The public API lives here; everything else is an implementation module.
"""

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
from llm_annotator.jobs import AnnotationResult, Annotator, OutputSchema, PromptTemplate
from llm_annotator.pool import (
    DirectorySource,
    DnsSource,
    FileSource,
    MemberState,
    MemberStatistics,
    PoolStatistics,
    ServerDiscovery,
    ServerSource,
    VLLMQueueAnnotator,
)
from llm_annotator.response import OnError, Response

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
