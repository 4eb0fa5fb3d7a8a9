"""The pool: one work queue over many servers, members, health, eviction, discovery."""

from typing import TYPE_CHECKING

from llm_annotator._lazy import lazy_names

if TYPE_CHECKING:
    from llm_annotator.pool.annotator import VLLMQueueAnnotator
    from llm_annotator.pool.discovery import (
        DirectorySource,
        DnsSource,
        FileSource,
        ServerDiscovery,
        ServerSource,
    )
    from llm_annotator.pool.member import MemberChange, MemberState, MemberStatistics
    from llm_annotator.pool.statistics import PoolStatistics

# Imported on first use (PEP 562): the job layer reads PoolStatistics and MemberState
# without loading the pool's dispatch and network client.
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "VLLMQueueAnnotator": "llm_annotator.pool.annotator",
        "DirectorySource": "llm_annotator.pool.discovery",
        "DnsSource": "llm_annotator.pool.discovery",
        "FileSource": "llm_annotator.pool.discovery",
        "ServerDiscovery": "llm_annotator.pool.discovery",
        "ServerSource": "llm_annotator.pool.discovery",
        "MemberChange": "llm_annotator.pool.member",
        "MemberState": "llm_annotator.pool.member",
        "MemberStatistics": "llm_annotator.pool.member",
        "PoolStatistics": "llm_annotator.pool.statistics",
    },
)

__all__ = [
    "DirectorySource",
    "DnsSource",
    "FileSource",
    "MemberChange",
    "MemberState",
    "MemberStatistics",
    "PoolStatistics",
    "ServerDiscovery",
    "ServerSource",
    "VLLMQueueAnnotator",
]
