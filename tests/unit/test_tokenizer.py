"""Tokenizer loading, encoding and chat templates.

transformers is the reference: the same file loaded with ``AutoTokenizer`` must give the same
ids and the same chat text. Tests on the real SmolLM2 GGUF are marked slow (the file is 98 MB
and transformers needs seconds to build its tokenizer); the tiny HF tokenizer runs fast.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corefleet.engine.frontend.tokenizer import ChatTemplateRefused, Tokenizer
from tests.fixtures_models import (
    BOS_TOKEN,
    EOS_TOKEN,
    write_tiny_gguf,
    write_tiny_model,
    write_tiny_tokenizer,
)
from tests.unit.tokenizer_helpers import CONVERSATIONS, VARIED

# -- SmolLM2 GGUF against transformers ----------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_path: str) -> Tokenizer:
    return Tokenizer.from_model_path(smollm2_path)


@pytest.fixture(scope="module")
def hf_smol(smollm2_path: str):
    from transformers import AutoTokenizer

    folder, name = os.path.split(smollm2_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.slow
@pytest.mark.parametrize("text", VARIED)
def test_gguf_encode_matches_transformers(smol: Tokenizer, hf_smol, text: str) -> None:
    assert smol.encode(text) == hf_smol.encode(text)
    assert smol.encode(text, add_special_tokens=False) == hf_smol.encode(
        text, add_special_tokens=False
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\n\n1.", [1116, 33, 30]),  # "\n\n" is one token; transformers gives 198, 198
        ("x  1", [104, 256, 33]),  # "  " (ĠĠ) is one token; transformers gives 216, 216
        ("tab\t\t3", [15999, 1656, 35]),
    ],
)
def test_gguf_digits_split_like_smollm2_tokenizer_json(
    smol: Tokenizer,
    hf_smol,
    text: str,
    expected: list[int],
) -> None:
    """Where transformers' GGUF converter ignores tokenizer.ggml.pre="smollm", follow SmolLM2's
    own tokenizer.json (Digits(individual) then ByteLevel), which llama.cpp also implements."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    original = Backend.from_str(hf_smol.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    assert smol.encode(text) == original.encode(text).ids == expected
    assert hf_smol.encode(text) != expected  # the documented transformers difference
    assert smol.decode(expected) == text


@pytest.mark.slow
@pytest.mark.parametrize("text", VARIED)
def test_gguf_decode_round_trips_and_matches_transformers(
    smol: Tokenizer,
    hf_smol,
    text: str,
) -> None:
    ids = smol.encode(text)
    assert smol.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert smol.decode(ids, skip_special_tokens=skip) == hf_smol.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.slow
def test_gguf_special_tokens(smol: Tokenizer, hf_smol) -> None:
    assert smol.vocab_size == len(hf_smol) == 49152
    assert (smol.bos_token, smol.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (smol.bos_token_id, smol.eos_token_id) == (hf_smol.bos_token_id, hf_smol.eos_token_id)
    assert set(hf_smol.all_special_ids) <= set(smol.all_special_ids)
    assert smol.all_special_ids == list(range(17))  # the 17 control tokens of the GGUF
    assert smol.encode("<|im_start|>") == [1]
    assert smol.decode([1, 19556, 2]) == "Hello"


@pytest.mark.slow
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(
    smol: Tokenizer,
    hf_smol,
    conversation: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    ours = smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf_smol.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


# -- tiny HF folder against transformers --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tok")
    dirs = {
        "absent": base / "absent",
        "bos": base / "bos",
        "jinja": base / "jinja",
    }
    write_tiny_tokenizer(dirs["absent"])
    write_tiny_tokenizer(dirs["bos"], add_bos_token=True)
    write_tiny_tokenizer(dirs["jinja"], chat_template_file=True)
    return dirs


@pytest.fixture(scope="module")
def tiny(tiny_dirs: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_model_path(tiny_dirs["absent"])


@pytest.mark.parametrize("variant", ["absent", "jinja"])
def test_hf_folder_matches_transformers(tiny_dirs: dict[str, Path], variant: str) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_model_path(tiny_dirs[variant])
    theirs = AutoTokenizer.from_pretrained(tiny_dirs[variant])
    for text in VARIED:
        assert ours.encode(text) == theirs.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    for conversation in CONVERSATIONS:
        for gen in (True, False):
            assert ours.apply_chat_template(conversation, add_generation_prompt=gen) == (
                theirs.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False)
            )
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.vocab_size == len(theirs)


def test_hf_folder_special_tokens(tiny: Tokenizer) -> None:
    assert (tiny.bos_token, tiny.eos_token) == (BOS_TOKEN, EOS_TOKEN)
    assert (tiny.bos_token_id, tiny.eos_token_id) == (0, 2)
    assert tiny.all_special_ids == [0, 1, 2]
    assert tiny.encode("<|im_start|>hi<|im_end|>")[0] == 1
    assert tiny.decode(tiny.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_add_bos_token_flag_without_post_processor(tiny_dirs: dict[str, Path]) -> None:
    # tokenizer.json has no post-processor here, so tokenizer_config's flag decides.
    with_bos = Tokenizer.from_model_path(tiny_dirs["bos"])
    without = Tokenizer.from_model_path(tiny_dirs["absent"])
    assert with_bos.encode("hi") == [0, *without.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == without.encode("hi")


def test_tokenizer_json_post_processor_wins(tmp_path: Path) -> None:
    """A tokenizer.json that adds BOS itself (Llama 3 style) is obeyed, like transformers."""
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers import processors
    from transformers import AutoTokenizer

    write_tiny_tokenizer(tmp_path, add_bos_token=False)
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B:1", special_tokens=[(BOS_TOKEN, 0)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["add_bos_token"] is False
    ours = Tokenizer.from_model_path(tmp_path)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    assert ours.encode("hello") == theirs.encode("hello")
    assert ours.encode("hello")[0] == 0


def test_tiny_gguf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    """The GGUF builder on another vocabulary: GPT-2 split, BOS added by the file's flag."""
    from transformers import AutoTokenizer

    folder = write_tiny_model(tmp_path / "hf")
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", folder, add_bos_token=True)
    ours = Tokenizer.from_model_path(gguf_path)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in VARIED:
        assert ours.encode(text) == theirs.encode(text), text
    assert ours.encode("hi")[0] == ours.bos_token_id == 0
    assert ours.apply_chat_template(CONVERSATIONS[1]) == theirs.apply_chat_template(
        CONVERSATIONS[1], add_generation_prompt=True, tokenize=False
    )


def test_unsupported_gguf_tokenizer_model(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "\u2581a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"spm\.gguf.*'llama'.*gpt2"):
        Tokenizer.from_model_path(path)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_model_path(tmp_path)


# -- chat template rendering --------------------------------------------------------------


def test_chat_template_variables_and_whitespace_control(tiny: Tokenizer) -> None:
    text = tiny.apply_chat_template([{"role": "user", "content": "  hi  "}])
    assert text == (
        f"{BOS_TOKEN}\n<|im_start|>system\nYou are tiny.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_raise_exception(tiny: Tokenizer) -> None:
    with pytest.raises(ChatTemplateRefused, match="unknown role: tool") as refused:
        tiny.apply_chat_template([{"role": "tool", "content": "x"}])
    assert isinstance(refused.value, ValueError)  # a client's mistake, not a server error


def test_chat_template_is_sandboxed() -> None:
    from jinja2.exceptions import SecurityError

    tok = Tokenizer(
        _tiny_backend(), chat_template="{{ messages.append({'role': 'x'}) }}{{ messages | length }}"
    )
    with pytest.raises(SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    escape = Tokenizer(
        _tiny_backend(), chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"
    )
    with pytest.raises(SecurityError):
        escape.apply_chat_template([])


def test_chat_template_tojson_generation_tag_and_kwargs() -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{{ tools | tojson }}"
    )
    tok = Tokenizer(_tiny_backend(), chat_template=template)
    text = tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}], tools=[{"a": 1}])
    assert text == '{"role": "user", "content": "<b>é</b>"}[{"a": 1}]'


def test_no_chat_template() -> None:
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(_tiny_backend()).apply_chat_template([{"role": "user", "content": "hi"}])


def _tiny_backend():
    from tests.fixtures_models import train_tiny_tokenizer

    return train_tiny_tokenizer()
