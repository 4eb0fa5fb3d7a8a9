"""``python -m llm_annotator.cli``: the ``llm-annotator`` command."""

from llm_annotator.cli.main import main

# Guarded: vLLM's engine (``run --offline-model``) starts its processes by spawning,
# which imports this module again in each of them.
if __name__ == "__main__":
    raise SystemExit(main())
