"""A job's ``postprocess`` hook: the row and its accepted answer in, columns out; an
exception makes the answer invalid (generated again, then an error row); it is in the
fingerprint by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llm_annotator import VLLMOnlineRuntimeOptions
from llm_annotator.errors import ConfigurationError, FingerprintMismatchError
from llm_annotator.jobs import Annotator
from tests.unit.conftest import FakeServer
from tests.unit.helpers import TEMPLATE, pool_of, read_output, rows

SAMPLED = VLLMOnlineRuntimeOptions(temperature=1.0)


def _sizes(row: dict[str, Any], answer: Any) -> dict[str, Any]:
    return {"answer_size": len(answer), "text_size": len(row["text"])}


def _refuse_odd(row: dict[str, Any], answer: Any) -> dict[str, Any]:
    if row["n"] % 2:
        raise ValueError("odd rows are refused")
    return {}


def _not_a_dict(row: dict[str, Any], answer: Any) -> Any:
    return ["a"]


def test_its_columns_join_the_output_row(fake_server: FakeServer, tmp_path: Path) -> None:
    with pool_of([fake_server]) as pool:
        Annotator(pool, progress=False).annotate(
            rows(6), TEMPLATE, tmp_path / "run", postprocess=_sizes, handle_signals=False
        )
    table = read_output(tmp_path / "run" / "annotations.parquet")
    assert [r["answer_size"] for r in table] == [len(r["response"]) for r in table]
    assert [r["text_size"] for r in table] == [len(r["text"]) for r in table]
    assert all(r["valid"] for r in table)


def test_an_exception_makes_the_answer_invalid_then_an_error_row(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    with pool_of([fake_server]) as pool:
        Annotator(pool, progress=False).annotate(
            rows(6),
            TEMPLATE,
            tmp_path / "run",
            options=SAMPLED,
            postprocess=_refuse_odd,
            max_regenerations=1,
            handle_signals=False,
        )
    table = read_output(tmp_path / "run" / "annotations.parquet")
    odd = [r for r in table if r["id"] % 2]
    assert all(r["error_type"] == "invalid_output" for r in odd)
    assert all("postprocess failed on the answer: ValueError" in r["error"] for r in odd)
    assert all(r["error"] is None for r in table if not r["id"] % 2)
    assert len(fake_server.requests) == 6 + 3  # each odd row generated once more


def test_a_hook_that_returns_no_dict_stops_the_job_with_the_row(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    with pool_of([fake_server]) as pool, pytest.raises(ConfigurationError, match="returned list"):
        Annotator(pool, progress=False).annotate(
            rows(3), TEMPLATE, tmp_path / "run", postprocess=_not_a_dict, handle_signals=False
        )


def test_another_hook_is_another_job(fake_server: FakeServer, tmp_path: Path) -> None:
    with pool_of([fake_server]) as pool:
        annotator = Annotator(pool, progress=False)
        annotator.annotate(
            rows(2), TEMPLATE, tmp_path / "run", postprocess=_sizes, handle_signals=False
        )
        with pytest.raises(FingerprintMismatchError, match="postprocess"):
            annotator.annotate(
                rows(2), TEMPLATE, tmp_path / "run", postprocess=_refuse_odd, handle_signals=False
            )
