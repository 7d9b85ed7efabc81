"""The offline ``LLM.chat`` hands ``tools`` to the model's chat template, as vLLM's does."""

from __future__ import annotations

import json
from pathlib import Path

from corefleet.engine import LLM, SamplingParams
from tests.fixtures_models import write_tiny_llama

# A template in the style of Qwen2.5's: the tools, as JSON, in the system turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)


def test_llm_chat_renders_the_tools_through_the_template(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"chat_template": TOOLS_TEMPLATE}))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    llm = LLM(str(model), multiprocess=False, dtype="float32", kv_cache_memory=8 << 20)
    try:
        greedy = SamplingParams(max_tokens=2, temperature=0.0)
        messages = [{"role": "user", "content": "Weather?"}]
        with_tools = llm.chat(messages, greedy, use_tqdm=False, tools=[tool])[0]
        without = llm.chat(messages, greedy, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert with_tools.prompt is not None and without.prompt is not None
    assert f"<tools>{json.dumps(tool)}</tools>" in with_tools.prompt
    assert "<tools>" not in without.prompt
    assert len(with_tools.outputs[0].token_ids) == 2
