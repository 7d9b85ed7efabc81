"""The offline ``LLM.chat`` takes vLLM's chat-template options: ``chat_template``,
``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from corefleet.engine import LLM, SamplingParams
from tests.fixtures_models import EOS_TOKEN, write_tiny_llama

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
QUESTION = {"role": "user", "content": "What is 2 + 2?"}
PARTIAL = {"role": "assistant", "content": "The answer is"}
SHOW = "{{ greeting }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    model = write_tiny_llama(tmp_path_factory.mktemp("llm") / "m")
    engine = LLM(str(model), multiprocess=False, dtype="float32", kv_cache_memory=8 << 20)
    yield engine
    engine.shutdown()


def test_a_template_and_its_kwargs(llm: LLM) -> None:
    messages = [{"role": "narrator", "content": "Once"}, QUESTION]
    out = llm.chat(
        messages,
        GREEDY,
        use_tqdm=False,
        chat_template=SHOW,
        chat_template_kwargs={"greeting": "hi"},
    )[0]
    assert out.prompt == "hi[narrator]Once[user]What is 2 + 2?"
    assert len(out.outputs[0].token_ids) == 2


def test_continue_final_message(llm: LLM) -> None:
    continued = llm.chat(
        [QUESTION, PARTIAL],
        GREEDY,
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    closed = llm.chat([QUESTION, PARTIAL], GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert continued.prompt is not None and closed.prompt is not None
    assert continued.prompt.endswith("The answer is")
    assert closed.prompt == f"{continued.prompt}{EOS_TOKEN}\n"


def test_refusals(llm: LLM) -> None:
    with pytest.raises(ValueError, match="Cannot set both"):
        llm.chat([QUESTION, PARTIAL], GREEDY, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="'messages'"):
        llm.chat([QUESTION], GREEDY, use_tqdm=False, chat_template_kwargs={"messages": []})
