"""Streaming detokenization and stop strings.

A token need not end on a character boundary: byte-level BPE splits an emoji or a CJK
character across tokens, and decoding such a prefix yields U+FFFD. Like vLLM, we keep two
offsets into the token list. ``prefix_offset..read_offset`` is text already emitted, decoded
again only as context (sentencepiece-style decoders drop a leading space at the start of what
they decode, so decoding a new token alone would lose it); ``read_offset..`` is new. A delta is
released only when the decoded text grows and does not end in U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence

from corefleet.engine.frontend.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "check_stop_strings"]

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context: enough for the decoder's view of a word boundary.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns the generated token ids of one sequence into text deltas, as tokens arrive."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._num_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""

    @property
    def output_text(self) -> str:
        """All text released so far."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids seen so far (the prompt context excluded)."""
        return self._ids[self._num_context :]

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that became stable (possibly "")."""
        # One id at a time, so that a batch ending mid-character still releases what came
        # before that character.
        deltas = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            deltas.append(self._release(force=False))
        return "".join(deltas)

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character decodes to U+FFFD).

        Call once when the sequence finishes, so the final text equals a full decode.
        """
        return self._release(force=True)

    def _release(self, force: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special)
        if not force and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT)):
            # Nothing new yet, or the last character is still incomplete: wait for more bytes.
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta


def check_stop_strings(
    text: str,
    new_delta_len: int,
    stops: Sequence[str],
    include_stop_str_in_output: bool,
) -> tuple[str, int] | None:
    """Find the earliest stop string that ends inside the newest ``new_delta_len`` characters.

    ``text`` is all output so far, its last ``new_delta_len`` characters just added. Matches
    lying wholly in older text were found by earlier calls, so only the tail window is searched
    (a stop string may start in old text and end in the new delta).

    Returns ``(stop_str, truncate_to)``: the output should become ``text[:truncate_to]``, which
    ends just before the stop string, or just after it with ``include_stop_str_in_output``.
    Returns None when no stop string matched. Among matches the earliest position wins, then
    the earlier entry of ``stops``.
    """
    if new_delta_len <= 0 or not stops:
        return None
    best: tuple[int, int, str] | None = None  # (position, order, stop)
    new_start = len(text) - new_delta_len
    for order, stop in enumerate(stops):
        if not stop:
            continue
        position = text.find(stop, max(0, new_start - len(stop) + 1))
        if position != -1 and (best is None or (position, order) < best[:2]):
            best = (position, order, stop)
    if best is None:
        return None
    position, _, stop = best
    return stop, position + len(stop) if include_stop_str_in_output else position
