"""The pool: one work queue over many servers, members, health, eviction, discovery.

The pool knows nothing of annotation jobs: :class:`QueuePool` is the pool alone, and
:class:`llm_annotator.VLLMQueueAnnotator`, above both layers, is the pool with
``annotate``.
"""

from typing import TYPE_CHECKING, Any

from llm_annotator._lazy import lazy_names, moved_modules

if TYPE_CHECKING:
    from llm_annotator.pool.discovery import (
        DirectorySource,
        DnsSource,
        FileSource,
        ServerDiscovery,
        ServerSource,
    )
    from llm_annotator.pool.lifecycle import MemberState
    from llm_annotator.pool.member import MemberChange, MemberStatistics
    from llm_annotator.pool.queue import QueuePool
    from llm_annotator.pool.statistics import PoolStatistics

# Imported on first use (PEP 562): the job layer reads PoolStatistics and MemberState
# without loading the pool's dispatch and network client.
_getattr, __dir__ = lazy_names(
    __name__,
    {
        "QueuePool": "llm_annotator.pool.queue",
        "DirectorySource": "llm_annotator.pool.discovery",
        "DnsSource": "llm_annotator.pool.discovery",
        "FileSource": "llm_annotator.pool.discovery",
        "ServerDiscovery": "llm_annotator.pool.discovery",
        "ServerSource": "llm_annotator.pool.discovery",
        "MemberChange": "llm_annotator.pool.member",
        "MemberState": "llm_annotator.pool.lifecycle",
        "MemberStatistics": "llm_annotator.pool.member",
        "PoolStatistics": "llm_annotator.pool.statistics",
    },
)

# Modules renamed or merged (one release): the end of a call; the failure rules, whose
# taxonomy (``policy``) joined the steps.
moved_modules(__name__, {"pace": "tail", "scheduler": "failures", "policy": "failures"})


def __getattr__(name: str) -> Any:
    if name == "VLLMQueueAnnotator":  # here until the pool and the jobs were parted
        # An ImportError, not an AttributeError: ``from llm_annotator.pool import
        # VLLMQueueAnnotator`` shows this message instead of "cannot import name".
        raise ImportError(
            "llm_annotator.pool.VLLMQueueAnnotator is now llm_annotator.VLLMQueueAnnotator "
            "(from llm_annotator import VLLMQueueAnnotator); llm_annotator.pool.QueuePool "
            "is the pool without annotate()"
        )
    return _getattr(name)


__all__ = [
    "DirectorySource",
    "DnsSource",
    "FileSource",
    "MemberChange",
    "MemberState",
    "MemberStatistics",
    "PoolStatistics",
    "QueuePool",
    "ServerDiscovery",
    "ServerSource",
]
