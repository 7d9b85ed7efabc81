"""Token-level sampling controls of a request (vLLM's): ``logit_bias``, ``allowed_token_ids``,
``bad_words`` and ``logprob_token_ids``: their bounds, their validation and the host-side rules
the sampler's metadata applies (which tokens a bad word bans now).

Kept apart from ``messages.py`` so that the wire types stay small; it imports nothing of the
engine at run time, so ``messages.py`` can call it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from corefleet.engine.messages import SamplingParams

# Bounds on what one request may ask for, so that checking and applying them stays cheap. They
# are vLLM's: its GPU model runner keeps this many logit-bias entries and logprob token ids
# per request, and VLLM_MAX_NUM_BAD_WORDS defaults to 128 tokenized bad words.
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGPROB_TOKEN_IDS = 128
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 1000
# A byte-level tokenizer can give a token per UTF-8 byte (4 per character), and a space.
MAX_BAD_WORD_TOKENS = 4 * MAX_BAD_WORD_CHARS + 1
# allowed_token_ids may list the whole vocabulary; this bounds it where the vocabulary size
# is not known yet (the HTTP layer's model); the engine checks it against the vocabulary.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# logit_bias values are clamped to this, as at OpenAI and vLLM.
MAX_ABS_LOGIT_BIAS = 100.0


def _fail(field: str, value: object, rule: str) -> NoReturn:
    # The same words as SamplingParams.validate: the HTTP layer names ``field`` from them.
    raise ValueError(f"invalid sampling parameter {field}={value!r}: {rule}")


def _out_of_vocab(ids: Sequence[object], vocab_size: int | None) -> list[object]:
    """The entries of ``ids`` that are not token ids (not ints, or outside the vocabulary)."""
    limit = math.inf if vocab_size is None else vocab_size
    return [t for t in ids if type(t) is not int or not 0 <= t < limit]


def validate_token_controls(params: SamplingParams, vocab_size: int | None) -> None:
    """Raise ``ValueError`` naming the first bad token-level control of ``params``."""
    vocab_rule = "must be token ids" + ("" if vocab_size is None else f" below {vocab_size}")
    if params.logit_bias is not None:
        bias = params.logit_bias
        if not isinstance(bias, dict):
            _fail("logit_bias", type(bias).__name__, "must map token ids to numbers")
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            _fail("logit_bias", f"<{len(bias)} entries>", f"at most {MAX_LOGIT_BIAS_TOKENS}")
        bad = _out_of_vocab(list(bias), vocab_size)
        if bad:
            _fail("logit_bias", bad[:5], f"keys {vocab_rule}")
        if not all(_finite_number(v) for v in bias.values()):
            _fail("logit_bias", "<values>", "values must be finite numbers")
    if params.allowed_token_ids is not None:
        _check_ids("allowed_token_ids", params.allowed_token_ids, vocab_size, vocab_rule)
        if not params.allowed_token_ids:
            _fail("allowed_token_ids", [], "must not be empty")
    if params.logprob_token_ids is not None:
        ids = params.logprob_token_ids
        _check_ids("logprob_token_ids", ids, vocab_size, vocab_rule, MAX_LOGPROB_TOKEN_IDS)
        if params.logprobs is not None and params.logprobs != len(ids):
            rule = f"logprobs ({params.logprobs}) must be unset or equal its length ({len(ids)})"
            _fail("logprob_token_ids", f"<{len(ids)} ids>", rule)
    _check_bad_words(params, vocab_size, vocab_rule)


def _finite_number(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]


def _check_ids(
    field: str,
    ids: object,
    vocab_size: int | None,
    vocab_rule: str,
    most: int = MAX_ALLOWED_TOKEN_IDS,
) -> None:
    if not isinstance(ids, list):
        _fail(field, type(ids).__name__, "must be a list of token ids")
    # The vocabulary bounds a list of distinct ids; a longer one only repeats some.
    most = min(most, vocab_size) if vocab_size is not None else most
    if len(ids) > most:
        _fail(field, f"<{len(ids)} ids>", f"at most {most}")
    bad = _out_of_vocab(ids, vocab_size)
    if bad:
        _fail(field, bad[:5], vocab_rule)


def _check_bad_words(params: SamplingParams, vocab_size: int | None, vocab_rule: str) -> None:
    words = params.bad_words
    if not isinstance(words, list):
        _fail("bad_words", type(words).__name__, "must be a list of strings")
    if len(words) > MAX_BAD_WORDS:
        _fail("bad_words", f"<{len(words)} words>", f"at most {MAX_BAD_WORDS} strings")
    if not all(isinstance(w, str) and 0 < len(w) <= MAX_BAD_WORD_CHARS for w in words):
        _fail("bad_words", "<words>", f"must be non-empty strings of at most {MAX_BAD_WORD_CHARS}")
    sequences = params.bad_words_token_ids
    if sequences is None:
        return
    # Each word is tokenized at most twice (with and without a leading space).
    if not isinstance(sequences, list) or len(sequences) > 2 * MAX_BAD_WORDS:
        _fail("bad_words_token_ids", "<lists>", f"at most {2 * MAX_BAD_WORDS} token id lists")
    for seq in sequences:
        if not isinstance(seq, list) or not seq:
            _fail("bad_words_token_ids", seq, "each must be a non-empty list of token ids")
        _check_ids("bad_words_token_ids", seq, None, vocab_rule, MAX_BAD_WORD_TOKENS)
        bad = _out_of_vocab(seq, vocab_size)
        if bad:
            _fail("bad_words", bad[:5], f"tokenize to ids outside the vocabulary ({vocab_size})")


def tokenize_bad_words(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token id sequences ``words`` ban, as vLLM's ``update_from_tokenizer``: each word
    as it is (stripped of leading spaces), and with one leading space when that makes a
    different first token of the same length (the word in the middle of a text).

    ``encode`` tokenizes without special tokens. A word that tokenizes to nothing bans nothing.
    """
    sequences: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if not bare:
            continue
        sequences.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences


def bad_word_bans(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens a request with these bad-word ``sequences`` may not sample next, given its
    generated tokens ``output``: the last token of each sequence whose other tokens are the
    end of ``output`` (vLLM's ``apply_bad_words``; the prompt does not count)."""
    banned: list[int] = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix :]) == list(seq[:prefix]):
            banned.append(seq[-1])
    return banned
