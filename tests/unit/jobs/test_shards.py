"""One job over several annotator processes (``--shard``), against in-process fake
servers: each row once over all shards, a killed shard re-run alone, the merge."""

from __future__ import annotations

import asyncio
import gzip
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm_annotator import ConfigurationError, JobError, VLLMQueueAnnotator
from llm_annotator.cli.main import main
from llm_annotator.errors import InputError
from llm_annotator.jobs.annotate import Annotator
from llm_annotator.jobs.ids import hash_id
from llm_annotator.jobs.rows.formats import dataset as dataset_reader
from llm_annotator.jobs.rows.formats import jsonl as jsonl_reader
from llm_annotator.jobs.rows.formats import parquet as parquet_reader
from llm_annotator.jobs.rows.inputs import open_input
from llm_annotator.jobs.rundir.store import DirectoryLock
from llm_annotator.jobs.shards import merge as merge_module
from llm_annotator.jobs.shards.merge import merge, merge_if_complete, shard_states
from llm_annotator.jobs.shards.shard import Shard
from llm_annotator.jobs.watch.status import run_status
from tests.cli import COMMAND
from tests.unit.conftest import FakeServer, completion
from tests.unit.helpers import FAST, write_rows


def shard_command(servers: list[FakeServer], data: Path, out: Path, shard: str) -> list[str]:
    return [
        COMMAND, "run", "--servers", *[s.base_url for s in servers], "--input", str(data),
        "--prompt-template", "Label: {text}", "--output-dir", str(out), "--shard", shard,
        "--log-format", "json", "--no-hedge-tail",  # exact request counts
    ]  # fmt: skip


def sent_ids(servers: list[FakeServer]) -> Counter[int]:
    return Counter(
        int(r["messages"][-1]["content"].removeprefix("Label: t"))
        for s in servers
        for r in s.requests
    )


def output_ids(path: Path) -> list[Any]:
    return pq.read_table(path, columns=["id"]).column("id").to_pylist()  # type: ignore[no-any-return]


def slow_by(seconds: float) -> Any:
    async def answer(body: dict[str, Any]) -> Any:
        await asyncio.sleep(seconds)
        return completion(body["messages"][-1]["content"])

    return answer


def test_the_shards_split_the_ids_into_balanced_disjoint_parts() -> None:
    ids: list[int | str] = [*range(6000), *(f"row-{i}" for i in range(6000))]
    owners = [[i for i in range(4) if Shard(i, 4).owns(row_id)] for row_id in ids]
    assert all(len(owner) == 1 for owner in owners)
    sizes = Counter(owner[0] for owner in owners)
    assert all(abs(size - 3000) < 300 for size in sizes.values())


def test_auto_reads_the_schedulers_index_or_says_what_is_missing() -> None:
    slurm = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert Shard.parse("auto", slurm) == Shard(3, 4)
    rerun = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "1"}  # sbatch --array=3
    assert Shard.parse("auto/4", rerun) == Shard(3, 4)
    with pytest.raises(ConfigurationError, match="submit the array as --array=0-0"):
        Shard.parse("auto", rerun)
    assert Shard.parse("auto", {"JOB_COMPLETION_INDEX": "2", "LLM_ANNOTATOR_SHARD_COUNT": "5"}) == (
        Shard(2, 5)
    )
    with pytest.raises(ConfigurationError, match="give the count, as auto/COUNT"):
        Shard.parse("auto", {"JOB_COMPLETION_INDEX": "2"})
    with pytest.raises(ConfigurationError, match="neither SLURM_ARRAY_TASK_ID"):
        Shard.parse("auto", {})
    with pytest.raises(ConfigurationError, match="expected INDEX/COUNT"):
        Shard.parse("2")
    with pytest.raises(ConfigurationError, match="the count must be an integer"):
        Shard.parse("1/x")


def test_three_shard_processes_send_each_row_once_and_the_last_merges(
    fake_servers: Any, tmp_path: Path
) -> None:
    servers = fake_servers(2)
    for server in servers:
        server.handler = slow_by(0.002)
    data = write_rows(tmp_path / "data.jsonl", 900)
    out = tmp_path / "run"
    processes = [
        subprocess.Popen(
            shard_command(servers, data, out, f"{i}/3"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for i in range(3)
    ]
    results = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], results
    assert sum("all shards merged" in stdout for stdout, _ in results) == 1
    assert sorted(output_ids(out / "annotations.parquet")) == list(range(900))
    assert sent_ids(servers) == Counter(range(900))  # every row once, over all shards
    for index in range(3):
        shard = Shard(index, 3)
        ids = output_ids(out / shard.name / "annotations.parquet")
        assert ids and all(shard.owns(row_id) for row_id in ids)
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["rows"] == report["succeeded"] == 900
    assert [s["shard"] for s in report["shards"]] == [0, 1, 2]
    assert main(["report", str(out)]) == 0  # the shards, and each one's plots
    page = (out / "report.html").read_text()
    assert "A job in 3 shards; merged into annotations.parquet." in page
    for index in range(3):
        assert f"<h2>Shard {index} of 3</h2>" in page
        assert f"<td>shard-{index:04d}-of-0003</td>" in page
    assert page.count("<svg") >= 9


def test_a_killed_shard_re_run_alone_sends_only_its_rows_left(
    fake_servers: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = fake_servers(2)
    for server in servers:
        server.handler = slow_by(0.1)
    data = write_rows(tmp_path / "data.jsonl", 600)
    out = tmp_path / "run"
    victim = Shard(1, 3)
    # 8 requests in flight at 0.1 s each: shard 1's 200-odd rows take about 3 s, so
    # the kill at 40 rows comes in the middle.
    slow = ["--batch-size", "4", "--max-concurrent-batches-per-client", "1"]
    killed = subprocess.Popen(
        [*shard_command(servers, data, out, "1/3"), *slow],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and written(out / victim.name) < 40:
            time.sleep(0.05)
        assert written(out / victim.name) >= 40
        assert killed.poll() is None, "shard 1 ended before the kill"
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
    for index in (0, 2):
        done = subprocess.run(
            shard_command(servers, data, out, f"{index}/3"),
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert "all shards merged" not in done.stdout
    _, states = shard_states(out)
    assert [s.state for s in states] == ["finished", "stopped", "finished"]
    assert main(["status", str(out)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"{out}: a job in 3 shards, 2 complete; not merged yet")
    assert f"{out / victim.name}: stopped" in shown
    assert main(["merge", str(out)]) == 1
    err = capsys.readouterr().err
    assert "1 of its 3 shards are not complete" in err
    assert "shard 1 of 3: stopped with" in err and "--shard 1/3" in err
    assert not (out / "annotations.parquet").exists()

    before = written(out / victim.name)
    for server in servers:
        server.requests.clear()
    again = subprocess.run(
        shard_command(servers, data, out, "1/3"),
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert "all shards merged" in again.stdout
    resent = sent_ids(servers)
    assert all(victim.owns(row_id) for row_id in resent)  # only its rows
    assert sum(resent.values()) == sum(victim.owns(i) for i in range(600)) - before
    assert sorted(output_ids(out / "annotations.parquet")) == list(range(600))


def test_a_shard_finishing_with_another_leaves_the_merge_to_it(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """Two shards that finish at the same moment both find every shard complete: the
    one that waited for the other's merge sees its output and does not merge again."""
    out = tmp_path / "run"
    rows = [{"text": f"t{i}"} for i in range(20)]
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        annotator = Annotator(pool, progress=False)
        for index in range(2):
            annotator.annotate(rows, "x {text}", out, shard=(index, 2))
    merged = out / "annotations.parquet"
    now = merged.stat().st_mtime_ns
    os.utime(merged, ns=(now - 10**10, now - 10**10))  # as if merged before a shard re-ran
    other = now + 10**9
    lock = DirectoryLock.acquire(out, "merge")  # the other shard's merge, until it ends

    def other_merge_ends() -> None:
        time.sleep(0.1)
        os.utime(merged, ns=(other, other))
        lock.release()

    ending = threading.Thread(target=other_merge_ends)
    ending.start()
    try:
        assert merge_if_complete(out) is None
    finally:
        ending.join()
    assert merged.stat().st_mtime_ns == other  # not written again
    os.utime(merged, ns=(now - 10**10, now - 10**10))  # older than the shards' outputs:
    assert merge_if_complete(out) is not None  # merged again


def test_a_shard_that_is_not_the_last_does_not_count_the_others_rows(
    fake_server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a shard has not finished, the others' merge check reads status files
    only: reading every finished shard's records would cost each of them CPU per row."""
    out = tmp_path / "run"
    rows = [{"text": f"t{i}"} for i in range(20)]
    counted: list[Path] = []

    def counting(directory: Path) -> Any:
        counted.append(directory)
        return run_status(directory)

    monkeypatch.setattr(merge_module, "run_status", counting)
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        annotator = Annotator(pool, progress=False)
        for index in range(2):
            annotator.annotate(rows, "x {text}", out, shard=(index, 3))
        assert counted == []
        assert annotator.annotate(rows, "x {text}", out, shard=(2, 3)).merged_path is not None
    assert sorted(set(counted)) == [out / Shard(i, 3).name for i in range(3)]


def written(folder: Path) -> int:
    """Complete lines in a shard's result files (a killed writer may leave half a one)."""
    total = 0
    for path in (folder / "shards").glob("*.jsonl") if folder.is_dir() else ():
        total += path.read_bytes().count(b"\n")
    return total


def test_another_count_or_no_shard_in_a_sharded_directory_is_refused(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    rows = [{"text": f"t{i}"} for i in range(30)]
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        annotator = Annotator(pool, progress=False)
        first = annotator.annotate(rows, "x {text}", out, shard=(0, 2))
        assert first.merged_path is None
        sent = len(fake_server.requests)
        with pytest.raises(ConfigurationError, match="split into 2 shards, not 3"):
            annotator.annotate(rows, "x {text}", out, shard=(0, 3))
        with pytest.raises(ConfigurationError, match="split into 2 shards: run each with"):
            annotator.annotate(rows, "x {text}", out)
        with pytest.raises(ConfigurationError, match="other settings"):
            annotator.annotate(rows, "y {text}", out, shard="1/2")
        with pytest.raises(ConfigurationError, match=r"trial run \(limit\) is not sharded"):
            annotator.annotate(rows, "x {text}", out, shard=(1, 2), limit=5)
        assert len(fake_server.requests) == sent  # nothing sent by a refused run
        with pytest.raises(JobError, match="shard 1 of 2: not started"):
            merge(out)
        last = annotator.annotate(rows, "x {text}", out, shard=(1, 2))
        assert last.merged_path == out / "annotations.parquet"
        assert sorted(output_ids(last.merged_path)) == list(range(30))
        annotator.annotate(rows, "x {text}", tmp_path / "plain")  # not sharded, then:
        with pytest.raises(ConfigurationError, match="not sharded; run without --shard"):
            annotator.annotate(rows, "x {text}", tmp_path / "plain", shard=(0, 2))


# Which rows a shard takes: the scan's selection against the definition, hash_id(id) % n


def jsonl_lines(ids: list[Any] | None, n: int) -> list[bytes]:
    """JSONL lines with blank and (without ids) malformed ones among them."""
    lines = []
    for i in range(n):
        row: dict[str, Any] = {"text": f"t{i}"}
        if ids is not None:
            row["id"] = ids[i]
        lines.append(orjson.dumps(row))
        if ids is None and i % 17 == 5:
            lines.append(b'{"text": "broken"')  # a row of its own: an error row
        if ids is None and i % 23 == 7:
            lines.append(b"[1, 2]")  # JSON, not an object
        if i % 13 == 0:
            lines.append(b"  ")  # blank: not a row
    return lines


def inputs_to_split(tmp_path: Path) -> dict[str, tuple[Any, str | None]]:
    """Inputs of every kind, with and without an id column: (data, id_column)."""
    n = 300
    strings = [f"row-{i}" for i in range(n)]
    ints = [i * 7919 - 1000 for i in range(n)]
    mixed: list[Any] = [i if i % 2 else f"{i}" for i in range(n)]  # 7 and "7" differ
    data: dict[str, tuple[Any, str | None]] = {}
    for name, ids in (("positions", None), ("str ids", strings), ("int ids", ints)):
        path = tmp_path / f"{name.replace(' ', '-')}.jsonl"
        path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(jsonl_lines(ids, n)) + b"\n")
        data[f"jsonl, {name}"] = (path, None if ids is None else "id")
    mixed_path = tmp_path / "mixed.jsonl.gz"
    mixed_path.write_bytes(gzip.compress(b"\n".join(jsonl_lines(mixed, n))))
    data["jsonl.gz, mixed ids"] = (mixed_path, "id")
    table = pa.table({"key": strings, "text": [f"t{i}" for i in range(n)], "n": ints})
    parquet = tmp_path / "d.parquet"
    pq.write_table(table, parquet, row_group_size=37)  # batches that do not start at 8k
    data["parquet, positions"] = (parquet, None)
    data["parquet, str ids"] = (parquet, "key")
    data["parquet, int ids"] = (parquet, "n")
    lines = ["key,text", *(f'{key},"t{i}\nx"' for i, key in enumerate(strings))]
    lines.insert(90, "")  # a blank line: not a row
    (good := tmp_path / "good.csv").write_text("\n".join(lines) + "\n")
    lines.insert(40, "only-one-field")  # an error row, without an id column
    (bad := tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
    data["csv, positions"] = (bad, None)
    data["csv, str ids"] = (good, "key")
    items: list[Any] = [{"id": key, "text": "x"} for key in strings]
    data["list, str ids"] = (items, "id")
    data["list, positions"] = ([*items[:50], "not a mapping", *items[50:]], None)
    data["table, int ids"] = (table.rename_columns(["key", "text", "id"]), "id")
    data["table, positions"] = (table, None)
    return data


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_a_shard_streams_exactly_the_rows_whose_id_hashes_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """The selection made by the scan, by position, picks the rows the definition does
    (every row read, then hash_id(row.id) % count == index), with their values, where
    and errors, for every kind of input; the shards' rows add up to the input."""
    monkeypatch.setattr(parquet_reader, "PARQUET_BATCH_ROWS", 16)
    monkeypatch.setattr(dataset_reader, "PARQUET_BATCH_ROWS", 16)
    monkeypatch.setattr(jsonl_reader, "_BLOCK_BYTES", 500)  # many blocks, some with blank lines
    for name, (data, id_column) in inputs_to_split(tmp_path).items():
        every = list(open_input(data, id_column=id_column))
        assert len({row.id for row in every}) == len(every) > 250, name
        taken = []
        for index in range(count):
            source = open_input(data, id_column=id_column)
            selection = Shard(index, count).select(source)
            expected = [row for row in every if hash_id(row.id) % count == index]
            rows = list(source.rows(selection))
            assert rows == expected, (name, index)
            assert (selection.rows, selection.taken) == (len(every), len(expected)), name
            taken += rows
        assert sorted(taken, key=every.index) == every, name


def test_other_shards_jsonl_lines_are_not_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan parses each line once; the stream parses only the shard's own lines."""
    path = write_rows(tmp_path / "data.jsonl", 4000)
    parsed = Counter[str]()
    loads = orjson.loads

    def counting(line: Any) -> Any:
        parsed["lines"] += 1
        return loads(line)

    monkeypatch.setattr(orjson, "loads", counting)
    source = open_input(path, id_column=None)
    selection = Shard(2, 4).select(source)
    assert parsed["lines"] == 1  # the first line, for the columns; positions need no parsing
    assert sum(1 for _ in source.rows(selection)) == selection.taken
    assert parsed["lines"] == 1 + selection.taken
    keyed = tmp_path / "keyed.jsonl"
    keyed.write_bytes(b"".join(b'{"id": "k%d", "t": 1}\n' % i for i in range(4000)))
    parsed.clear()
    source = open_input(keyed, id_column="id")
    selection = Shard(2, 4).select(source)
    assert parsed["lines"] == 1 + 4000
    assert [row.id for row in source.rows(selection)] == [
        f"k{i}" for i in range(4000) if Shard(2, 4).owns(f"k{i}")
    ]
    assert parsed["lines"] == 1 + 4000 + selection.taken


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b'{"id": "r5", "t": 1', "line 6: not valid JSON"),
        (b"[1]", "line 6: is JSON but not an object (a list)"),
        (b'{"t": 1}', "line 6 has no 'id' field"),
        (b'{"id": null}', "line 6: the id in field 'id' is null"),
        (b'{"id": ""}', "line 6: the id in field 'id' is empty"),
        (b'{"id": false}', "is False, a bool"),
        (b'{"id": 1.5}', "is 1.5, a float"),
        (b'{"id": "r2"}', "the id 'r2' (field 'id') appears more than once"),
    ],
)
def test_every_shard_refuses_a_bad_row_as_the_scan_does(
    tmp_path: Path, bad: bytes, message: str
) -> None:
    """A row without a valid id belongs to no shard: every shard refuses the input with
    the scan's message (which line, what to do), whichever shard the row would be in."""
    lines = [b'{"id": "r%d", "t": 1}' % i for i in range(12)]
    lines[5] = bad
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(InputError) as scanned:
        open_input(path, id_column="id").scan()
    assert message in str(scanned.value)
    for index in range(3):
        with pytest.raises(InputError) as selected:
            Shard(index, 3).select(open_input(path, id_column="id"))
        assert str(selected.value) == str(scanned.value)


def test_sharded_jobs_keyed_by_a_column_split_the_rows_and_count_them(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """Each shard's status counts its own rows (from the scan); the merge has them all."""
    data = tmp_path / "data.parquet"
    ids = [f"doc-{i}" for i in range(60)]
    pq.write_table(pa.table({"doc": ids, "text": [f"t{i}" for i in range(60)]}), data)
    out = tmp_path / "run"
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        annotator = Annotator(pool, progress=False)
        for index in range(3):
            annotator.annotate(str(data), "x {text}", out, id_column="doc", shard=(index, 3))
    for index in range(3):
        shard = Shard(index, 3)
        status = orjson.loads((out / shard.name / "status.json").read_bytes())
        assert status["total"] == status["done"] == sum(map(shard.owns, ids))
        assert sorted(output_ids(out / shard.name / "annotations.parquet")) == sorted(
            filter(shard.owns, ids)
        )
    assert sorted(output_ids(out / "annotations.parquet")) == sorted(ids)
    assert len(fake_server.requests) == 60
