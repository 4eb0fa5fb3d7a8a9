"""The pool: one work queue over many servers, members, health and eviction."""

from llm_annotator.pool.annotator import PoolStatistics, VLLMQueueAnnotator
from llm_annotator.pool.member import MemberState, MemberStatistics

__all__ = ["MemberState", "MemberStatistics", "PoolStatistics", "VLLMQueueAnnotator"]
