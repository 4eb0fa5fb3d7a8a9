"""``llm-annotator run --offline-model DIR``: the job's model in this process."""

from __future__ import annotations

from typing import Any

from llm_annotator.clients.vllm_offline_client import VLLMOfflineClient
from llm_annotator.errors import ConfigurationError

SERVER_SETTINGS = ("servers", "servers_file", "servers_dir", "servers_dns")
"""The settings that name servers; --offline-model takes their place."""
_FOR_SERVERS = (*SERVER_SETTINGS, "api_key_file", "api_key_env", "ca_bundle")
_POOL_SETTINGS = (
    "timeout",
    "hedge_tail",
    "adaptive",
    "prefix_affinity",
    "verify_tls",
    "max_response_bytes",
    "max_server_faults",
    "stall_window",
    "all_down_timeout",
)
"""Settings of the pool of servers, with defaults: set otherwise, they would do nothing
in process."""
_ENGINE_SETTINGS = (
    "tensor_parallel_size",
    "max_model_len",
    "dtype",
    "max_num_seqs",
    "gpu_memory_utilization",
    "enforce_eager",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_offline_settings(
    settings: dict[str, Any], defaults: dict[str, Any] | None = None
) -> None:
    """Refuse servers beside ``--offline-model``, and engine settings without it.

    Settings of the pool that differ from ``defaults`` (set on the command line or in
    the job file) are refused beside ``--offline-model`` too: they would do nothing.

    Raises:
        ConfigurationError: Naming the flags that do not go together.

    Examples:
        >>> check_offline_settings({"offline_model": None, "dtype": "float32"})
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: --dtype sets the in-process engine: ...
    """
    if settings.get("offline_model"):
        clash = [_flag(name) for name in _FOR_SERVERS if settings.get(name)]
        clash += [
            _flag(name)
            for name in _POOL_SETTINGS
            if defaults is not None and name in settings and settings[name] != defaults.get(name)
        ]
        if clash:
            raise ConfigurationError(
                f"--offline-model runs the model in this process, without servers: drop "
                f"{', '.join(clash)}, or drop --offline-model to use the servers"
            )
        return
    given = [_flag(name) for name in _ENGINE_SETTINGS if settings.get(name) is not None]
    if given:
        raise ConfigurationError(
            f"{', '.join(given)} sets the in-process engine: give --offline-model DIR too "
            "(servers take these settings when they start)"
        )


def offline_client(settings: dict[str, Any]) -> VLLMOfflineClient:
    """The in-process client the settings describe; ``--model`` names its answers.

    Raises:
        ConfigurationError: vLLM is missing from this Python, or could not start the
            engine on the model folder; the message says what to do.
    """
    folder = settings["offline_model"]
    engine = {name: settings[name] for name in _ENGINE_SETTINGS if settings.get(name) is not None}
    extra = {"enforce_eager": engine.pop("enforce_eager")} if "enforce_eager" in engine else None
    try:
        return VLLMOfflineClient(
            folder,
            served_model_name=settings.get("model"),
            dtype=engine.pop("dtype", "auto"),
            engine_kwargs=extra,
            **engine,
        )
    except ImportError as missing:
        raise ConfigurationError(f"--offline-model: {missing}") from None
    except ConfigurationError:
        raise
    except Exception as failed:  # vLLM's own errors: a wrong folder, too little memory, ...
        raise ConfigurationError(
            f"--offline-model {folder}: vLLM could not start the engine "
            f"({type(failed).__name__}: {failed}); check that the folder holds a model "
            "(config.json, weights, tokenizer) and that the engine settings fit this machine"
        ) from None


__all__ = ["SERVER_SETTINGS", "check_offline_settings", "offline_client"]
