"""The pool: one work queue over many servers, members, health, eviction, discovery."""

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
