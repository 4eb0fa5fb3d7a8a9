"""Every row's defect is that row's error: values that cannot be stored (a lone
surrogate, which ``surrogateescape`` decoding makes of undecodable bytes; a value that is
not JSON) are found before the row is sent and become ``input_error`` rows naming the
row, while every other row is annotated. Before, such a row stopped the whole job once
its answer arrived, on every rerun."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from llm_annotator import VLLMQueueAnnotator
from tests.unit.conftest import FakeServer
from tests.unit.helpers import FAST


@pytest.mark.parametrize(
    ("bad", "columns", "says"),
    [
        ({"text": "caf\udce9"}, None, "column 'text': str is not valid UTF-8"),
        ({"text": "ok", "note": "\udcff"}, None, "column 'note'"),
        ({"text": "caf\udce9"}, ["n"], "prompt holds text that is not valid Unicode"),
        ({"text": "ok", "tags": {"a"}}, None, "column 'tags': Type is not JSON serializable"),
        ({"text": "ok", "meta": {1: "x"}}, None, "column 'meta'"),
        ({"text": "ok", "b\udcffad": 1}, None, "column 'b\\udcffad'"),
    ],
)
def test_a_value_that_cannot_be_stored_is_that_rows_input_error(
    fake_server: FakeServer,
    tmp_path: Path,
    bad: dict[str, Any],
    columns: list[str] | None,
    says: str,
) -> None:
    rows: list[dict[str, Any]] = [{"text": f"t{i}", "n": i} for i in range(6)]
    rows[3] = {**bad, "n": 3}
    with VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST) as pool:
        result = pool.annotate(
            rows, "Label: {text}", tmp_path / "run", columns=columns, progress=False
        )
        sent = len(fake_server.requests)
        again = pool.annotate(
            rows, "Label: {text}", tmp_path / "run", columns=columns, progress=False
        )
    assert sent == 5, "the bad row was sent"
    assert len(fake_server.requests) == sent and again.num_resumed == 6
    assert (result.num_rows, result.num_succeeded, result.num_failed) == (6, 5, 1)
    table = {row["id"]: row for row in pq.read_table(result.output_path).to_pylist()}
    failed = table[3]
    assert failed["error_type"] == "input_error"
    assert failed["error"].startswith("list item 3: ") and says in failed["error"]
    assert failed["n"] == 3  # the columns that can be stored are kept
    assert all(table[i]["response"] == f"Label: t{i}" for i in (0, 1, 2, 4, 5))
