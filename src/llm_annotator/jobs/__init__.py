"""Annotation jobs: rows in, prompts rendered, answers checked, results stored once."""

from llm_annotator.jobs.annotate import AnnotationResult, Annotator
from llm_annotator.jobs.prompts import PromptTemplate
from llm_annotator.jobs.schema import OutputSchema

__all__ = ["AnnotationResult", "Annotator", "OutputSchema", "PromptTemplate"]
