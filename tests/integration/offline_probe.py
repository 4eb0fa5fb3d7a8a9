"""Run under the vLLM Python by tests/integration/test_offline_vllm.py.

``params MODEL``: for each case on stdin (a JSON list of VLLMBaseRuntimeOptions
fields), the engine's SamplingParams two ways: as vLLM's server builds them from the
online client's request body, and as the offline client builds them; prints, per case,
the fields that differ.

``generate MODEL DTYPE MAX_MODEL_LEN``: builds a VLLMOfflineClient and answers each
case on stdin (``{"messages": ..., "options": {...}}``) one at a time; prints the
Responses.

vLLM is imported inside the functions: the test suite's doctest collection imports this
module in an environment without vLLM.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# Fields that say how an answer is delivered, not what is decoded: the server streams
# or not and skips a copy; the offline client's engine call sets its own output kind.
DELIVERY_FIELDS = frozenset({"output_kind", "skip_clone"})
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def compare_params(model: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: the server's and the offline client's sampling parameters, field by
    field, and the fields where they differ."""
    import vllm
    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.tokenizers import get_tokenizer

    from llm_annotator import VLLMOfflineRuntimeOptions, VLLMOnlineRuntimeOptions
    from llm_annotator.clients.vllm_offline_client import build_sampling_params

    config = ModelConfig(model=model, max_model_len=512)
    defaults = config.get_diff_sampling_param()
    tokenizer = get_tokenizer(model)
    prompt_len = len(
        tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    )
    results = []
    for case in cases:
        body = VLLMOnlineRuntimeOptions(**case).to_payload()
        request = ChatCompletionRequest(model="m", messages=MESSAGES, **body)
        asked = (
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens
        )
        max_tokens = get_max_tokens(config.max_model_len, asked, prompt_len, defaults)
        server = request.to_sampling_params(max_tokens, defaults)
        offline = build_sampling_params(vllm, VLLMOfflineRuntimeOptions(**case), defaults)
        if offline.max_tokens is None:  # the engine fills in what the context leaves
            offline.max_tokens = config.max_model_len - prompt_len
        fields = [f for f in type(server).__struct_fields__ if f not in DELIVERY_FIELDS]
        differ = {
            f: [repr(getattr(server, f)), repr(getattr(offline, f))]
            for f in fields
            if getattr(server, f) != getattr(offline, f)
        }
        # The control: the same parameters built without the model's defaults, which
        # the comparison must tell apart wherever the model has defaults.
        control = build_sampling_params(vllm, VLLMOfflineRuntimeOptions(**case), {})
        control.max_tokens = offline.max_tokens
        control_differ = sorted(f for f in fields if getattr(server, f) != getattr(control, f))
        results.append(
            {
                "case": case,
                "defaults": defaults,
                "differ": differ,
                "control_differ": control_differ,
                "compared": len(fields),
            }
        )
    return results


def generate(model: str, dtype: str, max_model_len: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Each case answered alone by the offline client."""
    from llm_annotator import VLLMOfflineClient, VLLMOfflineRuntimeOptions

    answers = []
    with VLLMOfflineClient(
        model,
        dtype=dtype,
        max_model_len=max_model_len,
        on_error="ignore",
        engine_kwargs={"enforce_eager": True},  # as the server runs
    ) as client:
        for case in cases:
            response = client.generate(
                messages=case["messages"], options=VLLMOfflineRuntimeOptions(**case["options"])
            )
            answers.append(
                {
                    "text": response.text,
                    "finish_reason": response.finish_reason,
                    "num_prompt_tokens": response.num_prompt_tokens,
                    "num_output_tokens": response.num_output_tokens,
                    "error": response.error,
                    "error_type": response.error_type,
                }
            )
    return answers


def main() -> None:
    command, model, *rest = sys.argv[1:]
    cases = json.load(sys.stdin)
    if command == "params":
        result: Any = compare_params(model, cases)
    else:
        dtype, max_model_len = rest
        result = generate(model, dtype, int(max_model_len), cases)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
