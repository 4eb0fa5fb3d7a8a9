"""Pipelines: several annotation steps over one corpus, each step a resumable job.

A step reads a dataset, the rows an earlier step answered (filtered with ``where``), or
prompts to generate from; it may ask ``n`` answers per row and run ``preprocess`` and
``postprocess`` hooks. :class:`Pipeline` runs the steps in order in one directory,
skips what is done, resumes what was begun, and refuses to replace results whose
settings changed unless forced. ``llm-annotator pipeline run FILE`` runs the same from
a TOML file.
"""

from llm_annotator.pipeline.plan import StepPlan
from llm_annotator.pipeline.report import write_pipeline_report
from llm_annotator.pipeline.run import Pipeline, PipelineResult, StepResult, StepView
from llm_annotator.pipeline.steps import Step
from llm_annotator.pipeline.where import Where

__all__ = [
    "Pipeline",
    "PipelineResult",
    "Step",
    "StepPlan",
    "StepResult",
    "StepView",
    "Where",
    "write_pipeline_report",
]
