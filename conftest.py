"""Collection settings and fixtures shared by the doctests in src/ and the tests in tests/."""

from collections.abc import Iterator

import pytest
import structlog

# Run with the vLLM environment's python, not imported by the test run.
collect_ignore = ["src/llm_annotator/local/_tiny_model_script.py"]


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Each test starts with structlog's defaults: a command run in-process configures
    logging to the stderr of its own test, which is closed once that test ends."""
    yield
    structlog.reset_defaults()
