"""Grammars in the engine: compiled off the busy loop, cached, and turned into token masks.

As vLLM's ``StructuredOutputManager``: a request with ``structured_outputs`` gets its grammar
from a small thread pool (llguidance drops the GIL while it compiles) and waits in
``WAITING_FOR_FSM`` until it is ready; the scheduler admits it once its future is done. Each step,
while the model runs, :meth:`StructuredOutputManager.grammar_bitmask` fills the allowed-token
masks of the batch's constrained requests; after sampling, the scheduler advances each
request's matcher with its token.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from corefleet.engine.messages import StructuredOutputsParams
from corefleet.engine.structured_output.grammars import GrammarKey, grammar_key, to_llguidance

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (a request with the same grammar skips the compile).
_CACHE_SIZE = 256
_COMPILE_THREADS = 2


class GrammarError(ValueError):
    """A request's grammar cannot be compiled against the model's tokenizer."""


class StructuredOutputManager:
    """Compiles, caches and runs the grammars of one engine's requests.

    ``tokenizer_json`` loads the model's tokenizer as a Hugging Face ``tokenizers`` JSON
    string; it is called once, in the pool, by the first constrained request, so an engine
    that never sees one never pays for it. ``vocab_size`` is the width of the model's logits.
    """

    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_id: int | None
    ):
        self._tokenizer_source = tokenizer_json
        self.vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[GrammarKey, llguidance.LLMatcher] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.words = (vocab_size + 31) // 32  # int32 words per mask row

    def grammar_init(self, params: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """Start compiling a request's grammar; the future holds the request's own matcher
        (or a :class:`GrammarError`). A cached grammar completes at once."""
        key = grammar_key(params)
        with self._cache_lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is not None:
            done: Future[llguidance.LLMatcher] = Future()
            done.set_result(template.deep_copy())
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                _COMPILE_THREADS, thread_name_prefix="corefleet-grammar"
            )
        return self._pool.submit(self._compile, key)

    def _compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), to_llguidance(*key), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid structured_outputs.{key[0]}: {matcher.get_error()}")
        with self._cache_lock:
            self._cache[key] = matcher.deep_copy()
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_source(), n_vocab=self.vocab_size, eos_token=self._eos_token_id
                )
            return self._tokenizer

    def grammar_bitmask(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """``[K, V]`` bool: the tokens each matcher forbids next (row ``k`` for ``matchers[k]``).

        The engine calls it while the model runs; filling a row takes tens of microseconds.
        The mask comes out ready for ``masked_fill`` (True = banned), so that the sampler,
        which waits for it, does one pass over the logits and no negation.
        """
        bitmask = np.empty((len(matchers), self.words), dtype=np.int32)  # [K, W] bit per token
        row_bytes = self.words * 4
        base = bitmask.ctypes.data
        for k, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
        # Bit b of word w is token 32*w + b: little-endian words, little-endian bits.
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")  # [K, 32W]
        return np.ascontiguousarray(allowed[:, : self.vocab_size] == 0)  # [K, V] banned

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
