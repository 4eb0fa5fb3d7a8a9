# The two commands a newcomer needs are `make demo` and `make test`; the rest are parts.
.PHONY: demo test lint docs docs-build bench vllm-env

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy && .venv/bin/lint-imports

# The documentation: `make docs` builds it strictly into site/ (any warning fails), then
# serves it on http://127.0.0.1:8000 until Ctrl-C; `make docs-build` only builds.
docs: docs-build
	.venv/bin/mkdocs serve --strict

docs-build:
	.venv/bin/mkdocs build --strict --site-dir site

bench:
	.venv/bin/python benchmarks/client_overhead.py

vllm-env:
	bash scripts/vllm-env.sh
