"""Collection settings shared by the doctests in src/ and the tests in tests/."""

# Run with the vLLM environment's python, not imported by the test run.
collect_ignore = ["src/llm_annotator/_tiny_model.py"]
