# The two commands a newcomer needs are `make demo` and `make test`; the rest are parts.
.PHONY: demo test lint docs bench vllm-env

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy && .venv/bin/lint-imports

docs:
	.venv/bin/mkdocs build --strict --site-dir site

bench:
	.venv/bin/python benchmarks/client_overhead.py

vllm-env:
	bash scripts/vllm-env.sh
