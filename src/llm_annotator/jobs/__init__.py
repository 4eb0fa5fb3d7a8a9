"""Annotation jobs: rows in, prompts rendered, answers checked, results stored once."""

from typing import TYPE_CHECKING

from llm_annotator._lazy import lazy_names

if TYPE_CHECKING:
    from llm_annotator.jobs.annotate import AnnotationResult, Annotator
    from llm_annotator.jobs.prompts import PromptTemplate
    from llm_annotator.jobs.schema import OutputSchema

# Imported on first use (PEP 562): ``llm-annotator status`` reads a run directory
# through jobs.status without loading the pool and its network client.
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "AnnotationResult": "llm_annotator.jobs.annotate",
        "Annotator": "llm_annotator.jobs.annotate",
        "PromptTemplate": "llm_annotator.jobs.prompts",
        "OutputSchema": "llm_annotator.jobs.schema",
    },
)

__all__ = ["AnnotationResult", "Annotator", "OutputSchema", "PromptTemplate"]
