"""Write a tiny Llama model folder that vLLM can serve with random weights.

The folder holds a model configuration, a byte-level BPE tokenizer trained here on a
small built-in corpus, and a chat template; it holds no weights, so vLLM must serve it
with ``--load-format dummy``. Nothing is downloaded, and every run writes the same files.

This file is a standalone script: it needs only the standard library and the
``tokenizers`` package, and it imports nothing from ``llm_annotator``, because it runs
under the Python that has vLLM installed, which need not have this package::

    VLLM_PYTHON path/to/_tiny_model_script.py OUTDIR

:func:`llm_annotator.local.ensure_tiny_model` runs it that way.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"
UNK = "<unk>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, TURN_START, TURN_END]
"""Special tokens, in the order they take the first ids (pad=0, bos=1, eos=2, ...)."""

VOCAB_SIZE = 640
MODEL_MAX_LENGTH = 2048

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set text = message['content'] -%}"
    "{%- else -%}"
    "{%- set text = message['content'] | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
"""A ChatML-style template; ``enable_thinking=True`` opens a ``<think>`` line."""

_SUBJECTS = [
    "the annotator",
    "a careful reader",
    "the model",
    "every server",
    "our small team",
    "the reviewer",
    "a tired student",
    "the old library",
]
_VERBS = [
    "labels",
    "reads",
    "summarizes",
    "checks",
    "answers",
    "writes",
    "translates",
    "counts",
]
_OBJECTS = [
    "each sentence",
    "the long document",
    "a short question",
    "the json record",
    "every review",
    "the first paragraph",
    "a list of names",
    "the final report",
]
_ENDINGS = [
    "before lunch.",
    "with great care.",
    "in under a second.",
    "and then stops.",
    "because it must.",
    "while the queue grows.",
    "without any errors.",
    "for the dataset.",
]
_EXTRA_LINES = [
    'The answer is {"label": "positive", "score": 0.9}.',
    'Return JSON like {"sentiment": "negative", "reasons": ["slow", "late"]}.',
    "Is this review positive or negative? Answer with yes or no.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 -1.",
    "Punctuation: , . ; : ! ? ( ) [ ] { } < > / \\ | @ # $ % ^ & * - _ + = ~ ` ' \".",
    "User: hello there! Assistant: hi, how can I help you today?",
    "System: you are a helpful assistant that labels text.",
]


def corpus() -> list[str]:
    """Build the training text: a few hundred words, the same every time.

    Returns:
        Lines of English-like text with some JSON and punctuation.

    Examples:
        >>> lines = corpus()
        >>> lines == corpus() and len(lines) > 60
        True
    """
    lines = []
    n = len(_SUBJECTS)
    for i in range(64):
        subject = _SUBJECTS[i % n]
        verb = _VERBS[(i * 3 + 1) % n]
        obj = _OBJECTS[(i * 5 + 2) % n]
        ending = _ENDINGS[(i * 7 + 3) % n]
        lines.append(f"{subject.capitalize()} {verb} {obj} {ending}")
    lines.extend(_EXTRA_LINES)
    return lines


def model_config(vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """Describe a two-layer Llama small enough to run anywhere.

    Two heads of size 32 (vLLM's CPU attention needs a head size of 32, 64, 80, ...).

    Args:
        vocab_size: Size of the tokenizer's vocabulary.
        bos_id: Id of the beginning-of-sequence token.
        eos_id: Id of the end-of-sequence token.
        pad_id: Id of the padding token.

    Returns:
        The contents of ``config.json``.

    Examples:
        >>> config = model_config(640, 1, 2, 0)
        >>> config["hidden_size"] // config["num_attention_heads"]
        32
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def train_tokenizer() -> Any:
    """Train a byte-level BPE tokenizer on :func:`corpus`.

    Byte-level means any input text tokenizes, whatever its characters.

    Returns:
        A ``tokenizers.Tokenizer``.
    """
    # Imported here so that importing this module (doctests, tooling) works without it.
    tk = importlib.import_module("tokenizers")
    tokenizer = tk.Tokenizer(tk.models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # Plain-text prompts (the completions API) start with BOS, as Llama's do. Chat
    # prompts get BOS from the chat template and are encoded without special tokens.
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def write_model(directory: Path) -> None:
    """Write the tiny model's files into ``directory``, creating it if needed.

    Args:
        directory: Target folder; files already there are overwritten.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    bos_id = tokenizer.token_to_id(BOS)
    eos_id = tokenizer.token_to_id(EOS)
    pad_id = tokenizer.token_to_id(PAD)
    config = model_config(tokenizer.get_vocab_size(), bos_id, eos_id, pad_id)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "additional_special_tokens": [TURN_START, TURN_END],
        "model_max_length": MODEL_MAX_LENGTH,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "additional_special_tokens": [TURN_START, TURN_END],
    }
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, tokenizer.token_to_id(TURN_END)],
        "pad_token_id": pad_id,
    }
    for name, content in [
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
        ("generation_config.json", generation_config),
    ]:
        text = json.dumps(content, indent=2, sort_keys=True) + "\n"
        (directory / name).write_text(text, encoding="utf-8")


def main(argv: list[str]) -> int:
    """Write the tiny model into the folder named on the command line.

    Args:
        argv: The command-line arguments after the script name: one folder.

    Returns:
        The process exit status.
    """
    if len(argv) != 1:
        print("usage: _tiny_model_script.py OUTDIR", file=sys.stderr)
        return 2
    write_model(Path(argv[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
