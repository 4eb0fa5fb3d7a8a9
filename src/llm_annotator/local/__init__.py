"""Start and stop vLLM servers on this machine, for tests, benchmarks and small runs.

:func:`start_local_servers` launches one or more OpenAI-compatible vLLM servers, each
in its own process group, waits until every one answers ``/health``, and hands back a
:class:`LocalServers`. Without a model it serves a tiny Llama with random weights that
:func:`ensure_tiny_model` writes locally, so nothing is downloaded::

    with start_local_servers(2) as servers:
        print(servers.base_urls)  # ['http://127.0.0.1:41234/v1', ...]

vLLM runs under its own Python (see :func:`find_vllm_python`), usually the cached
environment that ``scripts/vllm-env.sh`` builds, because its pinned CPU build of torch
need not fit beside this package.

The defaults suit CPUs and the tiny model. On a machine with GPUs, ``gpus_per_server=K``
pins server *i* to GPUs *iK* .. *iK+K-1* (``CUDA_VISIBLE_DEVICES``) with tensor
parallelism over them, and ``servers_dir`` announces each healthy server in a ``*.url``
file for ``llm-annotator run --servers-dir``::

    start_local_servers(4, "Qwen/Qwen3-8B", gpus_per_server=2, dtype="auto",
                        enforce_eager=False, servers_dir="servers", max_model_len=None)

Each :class:`LocalServer` can be killed, paused and resumed, which is how the
integration tests make servers fail. A server is stopped when its handle is garbage
collected or this interpreter exits, so none outlives the process that started it
(unless that process is killed with SIGKILL: then ``kill -- -PID`` ends its group).
"""

from llm_annotator.errors import LocalServerError
from llm_annotator.local.process import LocalServer, pick_free_ports
from llm_annotator.local.servers import (
    BUILT_IN_MODELS,
    CACHE_ENV,
    COMPLETE_STAMP,
    SERVER_MODULE,
    SMALL_MODEL_DIRNAME,
    SMALL_MODEL_PACKAGE,
    TINY_MODEL_DIRNAME,
    VLLM_PYTHON_ENV,
    LocalServers,
    cache_dir,
    ensure_small_model,
    ensure_tiny_model,
    find_vllm_python,
    start_local_servers,
)

__all__ = [
    "BUILT_IN_MODELS",
    "CACHE_ENV",
    "COMPLETE_STAMP",
    "SERVER_MODULE",
    "SMALL_MODEL_DIRNAME",
    "SMALL_MODEL_PACKAGE",
    "TINY_MODEL_DIRNAME",
    "VLLM_PYTHON_ENV",
    "LocalServer",
    "LocalServerError",
    "LocalServers",
    "cache_dir",
    "ensure_small_model",
    "ensure_tiny_model",
    "find_vllm_python",
    "pick_free_ports",
    "start_local_servers",
]
