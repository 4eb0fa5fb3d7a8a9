"""deploy/slurm/ on a real single-node SLURM cluster, with CPU vLLM servers on the tiny model.

The server array runs the same ``server.sbatch`` a GPU cluster would, with the server
command, model and addresses overridden through its environment variables.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from llm_annotator.local import SERVER_MODULE
from tests.deploy.conftest import (
    REPO,
    SlurmCluster,
    is_healthy,
    poll,
    read_urls,
    tail,
    wait_until,
)

pytestmark = pytest.mark.slurm

SERVER_SBATCH = REPO / "deploy" / "slurm" / "server.sbatch"
SUBMIT = REPO / "deploy" / "slurm" / "submit.sh"
STARTUP_TIMEOUT = 240.0
"""Seconds for both servers to become healthy (20-120 s each on two shared cores)."""
STOP_TIMEOUT = 60.0
"""Seconds for a cancelled task to withdraw its URL and its server to stop."""
RUN_TIMEOUT = 480.0
"""Seconds for the annotate job to finish once the servers are up."""
ROWS = 3000
"""Rows to annotate: the tiny model answers with one token, so even in small batches two
CPU servers do a few hundred rows a second, and the run must last long enough for a
server to go in the middle."""
VLLM_ARGS = (
    "--load-format dummy --dtype float32 --max-model-len 512 --enforce-eager "
    "--disable-uvicorn-access-log"
)


@pytest.fixture
def server_env(vllm_python: str, tiny_model: Path, tmp_path: Path) -> dict[str, str]:
    """The settings of server.sbatch for a CPU vLLM server on the tiny model, on loopback."""
    return {
        "SERVERS_DIR": str(tmp_path / "servers"),
        "MODEL": str(tiny_model),
        "SERVED_MODEL_NAME": "tiny",
        "VLLM_CMD": f"{vllm_python} -m {SERVER_MODULE}",
        "VLLM_ARGS": VLLM_ARGS,
        "BIND_HOST": "127.0.0.1",
        "ADVERTISE_HOST": "127.0.0.1",
        "STARTUP_TIMEOUT": str(int(STARTUP_TIMEOUT)),
        "STOP_TIMEOUT": "10",
        # As llm_annotator.local starts CPU servers: one unpinned thread each, 1 GiB of
        # KV cache, nothing fetched from the network.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def _job_logs(folder: Path) -> str:
    return "\n".join(tail(path) for path in sorted(folder.glob("slurm-*.out")))


def _wait_for_servers(
    cluster: SlurmCluster, job: str, servers_dir: Path, count: int, logs: Path
) -> dict[str, str]:
    """Wait until ``count`` servers of ``job`` are announced and healthy; return them."""

    def ready() -> bool:
        if cluster.has_finished_task(job):
            states = cluster.task_states(job)
            pytest.fail(
                f"a server task ended before the servers were up: {states}\n{_job_logs(logs)}"
            )
        urls = read_urls(servers_dir)
        return len(urls) == count and all(is_healthy(url) for url in urls.values())

    wait_until(ready, STARTUP_TIMEOUT, f"{count} healthy servers", lambda: _job_logs(logs))
    return read_urls(servers_dir)


def _end_jobs(cluster: SlurmCluster, *jobs: str) -> None:
    """Cancel jobs and wait (bounded) until they are gone, so no server outlives a test."""
    cluster.cancel(*jobs)
    for job in jobs:
        poll(functools.partial(cluster.is_finished, job), STOP_TIMEOUT)


@pytest.mark.timeout(STARTUP_TIMEOUT + 3 * STOP_TIMEOUT + 120)
def test_server_array_announces_servers_and_withdraws_a_cancelled_one(
    slurm_cluster: SlurmCluster, server_env: dict[str, str], tmp_path: Path
) -> None:
    """Each array task announces a healthy server as <job>_<task>.url; scancel withdraws it.

    The cancelled task's URL file disappears and its server stops answering, while the
    other task's server goes on.
    """
    servers_dir = Path(server_env["SERVERS_DIR"])
    job = slurm_cluster.run(
        "sbatch", "--parsable", "--array=0-1", str(SERVER_SBATCH), env=server_env, cwd=tmp_path
    )
    job = job.strip().split(";")[0]
    try:
        urls = _wait_for_servers(slurm_cluster, job, servers_dir, 2, tmp_path)
        victim, survivor = f"{job}_1", f"{job}_0"
        assert set(urls) == {victim, survivor}
        for url in urls.values():
            assert url.startswith("http://127.0.0.1:"), url
            assert url.endswith("/v1"), url

        slurm_cluster.cancel(victim)
        wait_until(
            lambda: not (servers_dir / f"{victim}.url").exists(),
            STOP_TIMEOUT,
            f"{victim}.url to disappear",
            lambda: _job_logs(tmp_path),
        )
        wait_until(
            lambda: not is_healthy(urls[victim]),
            STOP_TIMEOUT,
            f"the server of {victim} to stop",
            lambda: _job_logs(tmp_path),
        )
        assert read_urls(servers_dir) == {survivor: urls[survivor]}
        assert is_healthy(urls[survivor])
    finally:
        _end_jobs(slurm_cluster, job)
    assert not list(servers_dir.glob("*.url")), "a cancelled server left its URL file"


def _annotator_command() -> Path:
    """The project's own ``llm-annotator``, beside this interpreter."""
    command = Path(sys.executable).with_name("llm-annotator")
    if not command.is_file():
        pytest.fail(f"no {command}: install the project (pip install -e .)")
    return command


def _rows_written(output_dir: Path) -> int:
    """How many result records the run has written to its shards so far."""
    count = 0
    for shard in output_dir.glob("shards/*.jsonl"):
        try:
            count += shard.read_bytes().count(b"\n")
        except FileNotFoundError:
            continue
    return count


def _run_setup(server_env: dict[str, str], tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """The input of ROWS reviews, the run folder, and submit.sh's environment."""
    input_path = tmp_path / "input.jsonl"
    with input_path.open("w", encoding="utf-8") as handle:
        for i in range(ROWS):
            handle.write(json.dumps({"text": f"review {i}: the service was slow but kind"}) + "\n")
    env = {
        **server_env,
        "SERVER_SBATCH_ARGS": "",  # no GPUs here
        "ANNOTATE_SBATCH_ARGS": "--cpus-per-task=1",  # the node has 2
        "LLM_ANNOTATOR": str(_annotator_command()),
        "SERVERS_WAIT": str(int(STARTUP_TIMEOUT)),
    }
    return input_path, tmp_path / "run", env


@pytest.mark.timeout(STARTUP_TIMEOUT + RUN_TIMEOUT + 3 * STOP_TIMEOUT + 120)
def test_annotation_run_survives_a_cancelled_server(
    slurm_cluster: SlurmCluster, server_env: dict[str, str], tmp_path: Path
) -> None:
    """submit.sh's run annotates every row exactly once, no error rows, though a server goes.

    One of the two server tasks is cancelled when a third of the rows are written, and
    its URL is withdrawn before the last row is; the annotator finishes on the other
    server, and the annotate job completes.
    """
    servers_dir = Path(server_env["SERVERS_DIR"])
    input_path, output_dir, env = _run_setup(server_env, tmp_path)
    submitted = slurm_cluster.run(
        "bash",
        str(SUBMIT),
        "-n", "2",
        "-i", str(input_path),
        "-o", str(output_dir),
        "-s", str(servers_dir),
        "--",
        "--prompt-template", "Is this review positive or negative? {text}",
        "--max-completion-tokens", "32",
        "--temperature", "0",
        # Small batches, few in flight: results arrive steadily, not in a few waves.
        "--batch-size", "4",
        "--max-concurrent-batches-per-client", "2",
        "--log-format", "json",
        env=env,
        cwd=tmp_path,
    )  # fmt: skip
    jobs = dict(line.split("=", 1) for line in submitted.split())
    server_job, annotate_job = jobs["server_job"], jobs["annotate_job"]
    try:
        _wait_for_servers(slurm_cluster, server_job, servers_dir, 2, tmp_path)

        def a_third_written() -> bool:
            if slurm_cluster.is_finished(annotate_job):
                pytest.fail(f"the annotate job ended early\n{_job_logs(tmp_path)}")
            return _rows_written(output_dir) >= ROWS // 3

        wait_until(
            a_third_written, RUN_TIMEOUT, "a third of the rows", lambda: _job_logs(tmp_path), 0.1
        )
        victim = f"{server_job}_1"
        slurm_cluster.cancel(victim)
        wait_until(
            lambda: not (servers_dir / f"{victim}.url").exists(),
            STOP_TIMEOUT,
            f"{victim}.url to disappear",
            lambda: _job_logs(tmp_path),
            0.1,
        )
        written_when_gone = _rows_written(output_dir)

        wait_until(
            lambda: slurm_cluster.is_finished(annotate_job),
            RUN_TIMEOUT,
            "the annotate job to finish",
            lambda: _job_logs(tmp_path),
        )
        states = slurm_cluster.task_states(annotate_job)
        assert states == {annotate_job: "COMPLETED"}, f"{states}\n{_job_logs(tmp_path)}"
    finally:
        _end_jobs(slurm_cluster, annotate_job, server_job)

    assert written_when_gone < ROWS, "the run ended before the server was gone"
    table = pq.read_table(output_dir / "annotations.parquet")
    ids = table.column("id").to_pylist()
    assert sorted(ids) == list(range(ROWS))
    error_columns = [name for name in ("error", "error_type") if name in table.column_names]
    assert error_columns, f"no error column among {table.column_names}"
    for name in error_columns:
        errors = [value for value in table.column(name).to_pylist() if value]
        assert not errors, f"{len(errors)} error rows, e.g. {errors[:3]}"


def _shard_rows_written(output_dir: Path, index: int, count: int) -> int:
    return _rows_written(output_dir / f"shard-{index:04d}-of-{count:04d}")


@pytest.mark.timeout(STARTUP_TIMEOUT + 2 * RUN_TIMEOUT + 3 * STOP_TIMEOUT + 180)
def test_sharded_run_as_an_annotator_array_with_a_requeued_task(
    slurm_cluster: SlurmCluster, server_env: dict[str, str], tmp_path: Path
) -> None:
    """submit.sh -a 3: three annotator tasks, each its own shard, then the merge job.

    Shard 1's task is requeued (scontrol requeue) when it has written a third of its
    rows; it starts again, resumes only its own shard (its report: the rows done before
    were not sent again), and the merge job puts every row in the output exactly once.
    """
    servers_dir = Path(server_env["SERVERS_DIR"])
    input_path, output_dir, env = _run_setup(server_env, tmp_path)
    submitted = slurm_cluster.run(
        "bash", str(SUBMIT), "-n", "2", "-a", "3",
        "-i", str(input_path), "-o", str(output_dir), "-s", str(servers_dir), "--",
        "--prompt-template", "Is this review positive or negative? {text}",
        "--max-completion-tokens", "32", "--temperature", "0",
        "--batch-size", "4", "--max-concurrent-batches-per-client", "1",
        "--log-format", "json",
        env=env, cwd=tmp_path,
    )  # fmt: skip
    jobs = dict(line.split("=", 1) for line in submitted.split())
    server_job, annotate_job, merge_job = (
        jobs["server_job"],
        jobs["annotate_job"],
        jobs["merge_job"],
    )
    victim = f"{annotate_job}_1"
    try:
        _wait_for_servers(slurm_cluster, server_job, servers_dir, 2, tmp_path)
        third = ROWS // 9  # a third of one shard's rows, about

        def a_third_of_shard_1() -> bool:
            if slurm_cluster.is_finished(victim):
                pytest.fail(f"shard 1 ended early\n{_job_logs(tmp_path)}")
            return _shard_rows_written(output_dir, 1, 3) >= third

        wait_until(
            a_third_of_shard_1, RUN_TIMEOUT, "a third of shard 1", lambda: _job_logs(tmp_path), 0.1
        )
        slurm_cluster.run("scontrol", "requeue", victim)
        wait_until(
            lambda: slurm_cluster.is_finished(merge_job),
            RUN_TIMEOUT + 240,  # a requeued task waits before it is eligible again
            "the merge job to finish",
            lambda: _job_logs(tmp_path),
        )
        states = {**slurm_cluster.task_states(annotate_job), **slurm_cluster.task_states(merge_job)}
        assert set(states.values()) == {"COMPLETED"}, f"{states}\n{_job_logs(tmp_path)}"
    finally:
        _end_jobs(slurm_cluster, merge_job, annotate_job, server_job)

    table = pq.read_table(output_dir / "annotations.parquet")
    assert sorted(table.column("id").to_pylist()) == list(range(ROWS))
    assert not [value for value in table.column("error").to_pylist() if value]
    shard = output_dir / "shard-0001-of-0003"
    report = json.loads((shard / "report.json").read_text())
    resumed, sent = report["this_run"]["resumed_rows"], report["this_run"]["sent_rows"]
    assert resumed >= third, "the requeued task did not resume its shard"
    assert resumed + sent == report["rows"], report["this_run"]  # only its rows left
    merged = json.loads((output_dir / "report.json").read_text())
    assert [s["shard"] for s in merged["shards"]] == [0, 1, 2]
    assert sum(s["rows"] for s in merged["shards"]) == ROWS


@pytest.mark.timeout(STARTUP_TIMEOUT + RUN_TIMEOUT + 3 * STOP_TIMEOUT + 180)
def test_a_pipeline_over_a_corpus_by_elastic_workers_as_an_annotator_array(
    slurm_cluster: SlurmCluster, server_env: dict[str, str], tmp_path: Path
) -> None:
    """submit.sh -p FILE -e 2: a 2-step pipeline over a folder of 6 files, by two array
    tasks that run the same `pipeline run --shard claim` and share each step's units by
    claims (the first step a corpus taken by elastic workers); the last job says how
    each step stands and frees the servers; every (file, id) of each step once."""
    servers_dir = Path(server_env["SERVERS_DIR"])
    _, output_dir, env = _run_setup(server_env, tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    per_file = ROWS // 6
    for f in range(6):
        lines = (json.dumps({"text": f"review {f}-{i}: fine"}) for i in range(per_file))
        (corpus / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    pipeline = tmp_path / "pipeline.toml"
    pipeline.write_text(
        f'output_dir = "{tmp_path / "elsewhere"}"\n'  # OUTPUT_DIR (-o) replaces it
        f'input = "{corpus}"\n'
        "max_completion_tokens = 8\ntemperature = 0\n"
        "batch_size = 8\nmax_concurrent_batches_per_client = 1\n"
        'log_format = "json"\n'
        '[steps.label]\nprompt_template = "Is this review positive or negative? {text}"\n'
        '[steps.short]\nfrom = "label"\n'
        'prompt_template = "Say it in one word: {label_response}"\n'
    )
    submitted = slurm_cluster.run(
        "bash", str(SUBMIT), "-n", "2", "-e", "2", "-p", str(pipeline),
        "-o", str(output_dir), "-s", str(servers_dir),
        env=env, cwd=tmp_path,
    )  # fmt: skip
    jobs = dict(line.split("=", 1) for line in submitted.split())
    server_job, annotate_job, merge_job = (
        jobs["server_job"],
        jobs["annotate_job"],
        jobs["merge_job"],
    )
    try:
        _wait_for_servers(slurm_cluster, server_job, servers_dir, 2, tmp_path)
        wait_until(
            lambda: slurm_cluster.is_finished(merge_job),
            RUN_TIMEOUT + 120,
            "the last job to finish",
            lambda: _job_logs(tmp_path),
        )
        states = {**slurm_cluster.task_states(annotate_job), **slurm_cluster.task_states(merge_job)}
        assert set(states.values()) == {"COMPLETED"}, f"{states}\n{_job_logs(tmp_path)}"
    finally:
        _end_jobs(slurm_cluster, merge_job, annotate_job, server_job)

    assert not (tmp_path / "elsewhere").exists()
    label = output_dir / "steps" / "label"
    table = pads.dataset(label / "annotations", format="parquet").to_table()
    keys = list(
        zip(table.column("input_file").to_pylist(), table.column("id").to_pylist(), strict=True)
    )
    assert len(keys) == len(set(keys)) == per_file * 6
    answered = sum(1 for error in table.column("error").to_pylist() if not error)
    short = pads.dataset(output_dir / "steps" / "short" / "annotations", format="parquet")
    read = short.to_table(columns=["input_file", "id"])
    second = list(
        zip(read.column("input_file").to_pylist(), read.column("id").to_pylist(), strict=True)
    )
    assert len(second) == len(set(second)) == answered
    record = json.loads((output_dir / "pipeline.json").read_text())
    assert {name: step["state"] for name, step in record["steps"].items()} == {
        "label": "done",
        "short": "done",
    }
    manifest = json.loads((label / "annotations" / "_manifest.json").read_text())
    assert manifest["complete"] and manifest["units_done"] == 6
    assert len(list(label.glob("worker-*"))) == 2  # both tasks were workers
