"""The ``llm-annotator`` command: :func:`main` and its parser.

Subcommands, one module each: ``run`` (:mod:`~llm_annotator.cli.run`), ``serve-local``
and ``tiny-model`` (:mod:`~llm_annotator.cli.serve_local`), ``demo``
(:mod:`~llm_annotator.cli.demo`).
"""

from llm_annotator.cli._logging import configure_logging
from llm_annotator.cli.main import build_parser, main

__all__ = ["build_parser", "configure_logging", "main"]
