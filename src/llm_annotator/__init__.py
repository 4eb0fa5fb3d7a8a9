"""llm_annotator: annotate datasets with LLMs over a pool of vLLM servers.

The public API lives here; everything else is an implementation module.
"""

from llm_annotator.clients.base import Client, ProviderRuntimeOptions
from llm_annotator.clients.openai_client import OpenAIClient
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
    ErrorKind,
    FingerprintMismatchError,
    InputError,
    JobError,
    LLMAnnotatorError,
    MalformedResponseError,
    PoolExhaustedError,
    PromptError,
    ProviderError,
    ReadTimeoutError,
    RunInterruptedError,
    ServerConnectError,
    StatusError,
    TransportError,
)
from llm_annotator.pool import MemberState, MemberStatistics, PoolStatistics, VLLMQueueAnnotator
from llm_annotator.response import OnError, Response

__version__ = "0.1.0"

__all__ = [
    "MAX_CONNECTIONS",
    "Client",
    "ConfigurationError",
    "DisconnectedError",
    "ErrorKind",
    "FingerprintMismatchError",
    "InputError",
    "JobError",
    "LLMAnnotatorError",
    "MalformedResponseError",
    "MemberState",
    "MemberStatistics",
    "OnError",
    "OpenAIClient",
    "PoolExhaustedError",
    "PoolStatistics",
    "PromptError",
    "ProviderError",
    "ProviderRuntimeOptions",
    "ReadTimeoutError",
    "Response",
    "RunInterruptedError",
    "ServerConnectError",
    "StatusError",
    "TransportError",
    "VLLMBaseRuntimeOptions",
    "VLLMOnlineClient",
    "VLLMOnlineRuntimeOptions",
    "VLLMQueueAnnotator",
    "__version__",
    "server_is_healthy",
]
