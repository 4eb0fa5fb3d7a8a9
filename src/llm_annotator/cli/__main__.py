"""``python -m llm_annotator.cli``: the ``llm-annotator`` command."""

from llm_annotator.cli.main import main

raise SystemExit(main())
