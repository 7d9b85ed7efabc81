"""Tokenizer: a ``tokenizers.Tokenizer`` plus special tokens and the model's chat template.

Two sources, no transformers at run time:

* a Hugging Face folder: ``tokenizer.json`` as saved, with ``tokenizer_config.json`` for the
  special tokens, the ``add_bos_token``/``add_eos_token`` flags (used only when tokenizer.json
  has no post-processor) and the chat template (also read from ``chat_template.jinja`` or
  ``chat_template.json``);
* a GGUF file: a byte-level BPE rebuilt from the metadata (see ``_gguf_backend``).

Incremental detokenization for streaming lives in ``corefleet.engine.frontend.detokenizer``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from corefleet.engine.frontend.chat_template import (
    ChatTemplateRefused,
    render_chat_template,
)
from corefleet.engine.models.gguf_metadata import (
    GGUFTokenizerMetadata,
    read_gguf_tokenizer_metadata,
)

__all__ = ["BOTH_PROMPT_FLAGS", "RESERVED_TEMPLATE_KWARGS", "ChatTemplateRefused", "Tokenizer"]

# vLLM's words for a request that both opens a new turn and continues the last one.
BOTH_PROMPT_FLAGS = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
# Template arguments a caller's kwargs may not set: the conversation, the tools (their own
# argument) and transformers' render options. vLLM refuses chat_template and tokenize outright;
# messages, conversation and tools fail there as arguments given twice.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "chat_template", "tokenize"}
)

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# How text is split before byte-level BPE, keyed by tokenizer.ggml.pre (llama.cpp's name for
# the original tokenizer.json's pre-tokenizer). "smollm" (and StarCoder-style vocabularies)
# isolate every digit, then apply GPT-2's regex: SmolLM2's tokenizer.json is exactly
# Sequence[Digits(individual_digits), ByteLevel], and llama.cpp does the same. transformers'
# GGUF converter ignores this key for "smollm" and only applies GPT-2's regex, which differs
# when whitespace runs precede a digit ("\n\n1." is [1116, 33, 30] in the original, [198, 198,
# 33, 30] there); we follow the tokenizer the model was trained with.
_DIGIT_ISOLATING = frozenset({"smollm", "starcoder", "refact"})
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Llama 3's tokenizer.json sets ignore_merges (a whole word found in the vocabulary wins).
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe"})


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template

    @classmethod
    def from_model_path(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer of a Hugging Face folder or a ``.gguf`` file.

        Raises:
            ValueError: no tokenizer.json in the folder, or a GGUF tokenizer type other than
                byte-level BPE (``gpt2``).
        """
        p = Path(path)
        if p.is_dir():
            return _from_hf_folder(p)
        if p.suffix.lower() == ".gguf" and p.is_file():
            return _from_gguf(str(p))
        raise ValueError(f"{os.fspath(path)} is neither a model folder nor a .gguf file")

    # -- encoding -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as the model wants."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Incomplete UTF-8 sequences decode to U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (special tokens included): a text longer
        than this many times N characters has more than N tokens."""
        count = self.backend.get_vocab_size(with_added_tokens=True)
        decode = self.backend.decode
        return max(len(decode([i], skip_special_tokens=False)) for i in range(count))

    def token_to_id(self, token: str) -> int | None:
        """The id of a token spelled as in the vocabulary, or None."""
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if the model has one."""
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, if the model has one."""
        return self._id(self.eos_token)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every special token (those ``skip_special_tokens`` drops), sorted."""
        added = self.backend.get_added_tokens_decoder()
        ids = {i for i, tok in added.items() if tok.special}
        ids.update(i for i in (self.bos_token_id, self.eos_token_id) if i is not None)
        return sorted(ids)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # -- chat -----------------------------------------------------------------------------

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer with ``chat_template`` in place of the model's (a server's
        ``--chat-template``); the backend is shared, this one is left as it was."""
        other = copy.copy(self)
        other.chat_template = chat_template
        return other

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with ``chat_template``, else the model's Jinja chat template.

        The template sees ``messages``, ``add_generation_prompt``, ``documents`` (when given),
        the special tokens (``bos_token``, ``eos_token``, ...) and any ``kwargs`` (e.g.
        ``tools``, ``enable_thinking``), which may override the special tokens, as with
        transformers' ``apply_chat_template(tokenize=False)``. ``continue_final_message``
        leaves the last message open (no end-of-turn after it) for the model to continue.

        Raises:
            ValueError: no template (neither given nor the model's), or both
                ``continue_final_message`` and ``add_generation_prompt``.
            ChatTemplateRefused: the template rejected the conversation (its
                ``raise_exception``, e.g. a role it does not know) or could not render it.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError(BOTH_PROMPT_FLAGS)
        variables: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        if documents is not None:
            variables["documents"] = documents
        variables.update(kwargs)
        return render_chat_template(
            template,
            [dict(m) for m in messages],
            add_generation_prompt,
            variables,
            continue_final_message=continue_final_message,
        )


# -- Hugging Face folder ------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _bos_eos_processor(
    backend: Backend, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    single, special = "$A:0", []
    if add_bos and bos is not None and backend.token_to_id(bos) is not None:
        single = f"{bos}:0 {single}"
        special.append((bos, backend.token_to_id(bos)))
    if add_eos and eos is not None and backend.token_to_id(eos) is not None:
        single = f"{single} {eos}:0"
        special.append((eos, backend.token_to_id(eos)))
    pair = f"{single} {single.replace('$A:0', '$B:1').replace(':0', ':1')}"
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _from_hf_folder(folder: Path) -> Tokenizer:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(
            f"{folder} has no tokenizer.json (slow sentencepiece-only tokenizers are not "
            "supported; save the tokenizer with a recent transformers to get one)"
        )
    backend = Backend.from_file(str(tokenizer_file))
    config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    tokens = {n: _token_content(config.get(n)) or _token_content(special_map.get(n)) for n in names}
    # tokenizer.json's own post-processor decides BOS/EOS when it has one (Llama 3 adds
    # <|begin_of_text|> there; transformers 5 ignores tokenizer_config's flags in that case).
    # Without one, honour add_bos_token/add_eos_token as transformers 4's Llama tokenizer did:
    # transformers 5 would add nothing, silently dropping a BOS the model was trained with.
    if backend.post_processor is None:
        backend.post_processor = _bos_eos_processor(
            backend,
            tokens["bos_token"],
            tokens["eos_token"],
            bool(config.get("add_bos_token", False)),
            bool(config.get("add_eos_token", False)),
        )
    return Tokenizer(backend, chat_template=_chat_template(folder, config), **tokens)


# -- GGUF ---------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge rule ``"left right"`` as the pair a BPE model takes."""
    left, space, right = merge.partition(" ")
    if not space:
        raise ValueError(f"malformed GGUF merge rule {merge!r}: expected 'left right'")
    return left, right


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)  # bytes without a printable glyph move past U+00FF
            extra += 1
    return mapping


def _gguf_backend(meta: GGUFTokenizerMetadata, path: str) -> Backend:
    """Byte-level BPE equivalent to the tokenizer llama.cpp builds from the same metadata."""
    if meta.model != "gpt2":
        raise ValueError(
            f"{path}: GGUF tokenizer model {meta.model!r} is not supported; supported: "
            "['gpt2'] (byte-level BPE)"
        )
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens are stored in the byte alphabet already; respell any that are not (rare), the way
    # their bytes would appear after the ByteLevel pre-tokenizer.
    tokens = [
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))
        for t in meta.tokens
    ]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [_merge_pair(m) for m in meta.merges]
    pre = meta.pre
    backend = Backend(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES, fuse_unk=False)
    )
    if pre in _DIGIT_ISOLATING:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:  # "gpt-2", "default" and unknown names: GPT-2's own split
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) must match whole in raw text and be skippable as
    # special; user-defined ones (<think>) match whole but stay ordinary text. A control token
    # spelled outside the byte alphabet is a converter mislabel and would get a new id: skip it.
    named = {meta.bos_id, meta.eos_id, meta.unk_id, meta.pad_id} - {None}
    types = meta.token_types or [0] * len(tokens)
    special = [
        AddedToken(t, special=True, normalized=False)
        for i, (t, kind) in enumerate(zip(meta.tokens, types, strict=False))
        if (kind == _CONTROL or i in named) and set(t) <= spelled
    ]
    backend.add_special_tokens(special)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(meta.tokens, types, strict=False)
        if kind == _USER_DEFINED and t in vocab
    ]
    backend.add_tokens(user)
    return backend


def _from_gguf(path: str) -> Tokenizer:
    meta = read_gguf_tokenizer_metadata(path)
    backend = _gguf_backend(meta, path)
    # A BPE vocabulary adds no BOS unless the file says so (llama.cpp's rule for "gpt2").
    bos, eos = meta.token(meta.bos_id), meta.token(meta.eos_id)
    backend.post_processor = _bos_eos_processor(backend, bos, eos, meta.add_bos, meta.add_eos)
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=meta.token(meta.unk_id),
        pad_token=meta.token(meta.pad_id),
        chat_template=meta.chat_template,
    )
