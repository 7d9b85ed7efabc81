"""How much one client may ask of the API: sizes, counts and concurrency, all bounded.

Every size a client controls is checked before anything is allocated for it: the body's bytes
(413), the number of completions a request asks for (``n`` × prompts, 400), the stop lists, the
messages, and in-flight requests (429 with ``Retry-After``). The flags that set them are in
``corefleet serve --help``; ``docs/operations.md`` explains each.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# Static bounds: a request beyond them is refused with a 400 naming the field. They are far
# above what any real client sends and low enough that checking a request stays cheap.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1000  # a longer stop string would hold back the whole stream
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096
# A grammar (JSON schema, regex, choices, EBNF) is checked on the event loop before queueing:
# bounded so that a check stays a millisecond-scale task, whatever a client sends.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_TOOLS = 128  # OpenAI's limit on the functions one request may offer
MAX_CACHE_SALT_CHARS = 1024  # vLLM's bound on cache_salt
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# When no --max-n is given and the ranks have not said their batch size yet.
FALLBACK_MAX_N = 256
# A request refused for load is told to come back after this long (the Retry-After header).
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class RequestLimits:
    """The API's limits; ``None`` means "derived from the ranks" where a field says so."""

    # Most completions one request may ask for (n × prompts; best_of too). None: the ranks'
    # --max-num-seqs, so that one request never needs more than one batch.
    max_n: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Completions in flight at once, server-wide. None: the ready ranks' total --max-num-seqs,
    # so an admitted request joins a batch at once instead of queueing on a rank: past
    # saturation, admitted requests keep a short time to first token and the rest get 429.
    max_concurrent_requests: int | None = None
    # Completions in flight at once per API key (only with API keys). None: no per-key limit.
    max_concurrent_requests_per_key: int | None = None
    # Connections: beyond max_connections uvicorn answers 503 at once; a connection that has
    # not sent a whole request head within header_timeout_s is closed, as is one idle for
    # keep_alive_timeout_s between requests (slowloris and idle-socket floods).
    max_connections: int = 4096
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: int = 5
    # A request body that has not fully arrived after this long gets 408 (a slow-POST client).
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "max_n",
            "max_concurrent_requests",
            "max_concurrent_requests_per_key",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if min(self.header_timeout_s, self.keep_alive_timeout_s, self.body_timeout_s) <= 0:
            raise ValueError("the header, body and keep-alive timeouts must be positive")

    def effective_max_n(self, rank_max_num_seqs: int | None) -> int:
        """The ``n`` × prompts bound in force, given the ranks' batch size (None: unknown)."""
        if self.max_n is not None:
            return self.max_n
        return rank_max_num_seqs or FALLBACK_MAX_N

    def effective_max_concurrent(self, total_max_num_seqs: int) -> int:
        """The server-wide in-flight bound, given the ready ranks' total batch size."""
        if self.max_concurrent_requests is not None:
            return self.max_concurrent_requests
        return max(1, total_max_num_seqs)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The ``--max-*`` and timeout flags of :class:`RequestLimits`, as one argument group."""
    defaults = RequestLimits()
    g = parser.add_argument_group("limits on what one client may ask (see docs/operations.md)")
    g.add_argument(
        "--max-n",
        type=int,
        default=None,
        help="most completions one request may ask for, n × prompts (default: the ranks' "
        "--max-num-seqs); beyond it a 400",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=defaults.max_request_body_bytes,
        help=f"largest request body; beyond it a 413 (default {defaults.max_request_body_bytes})",
    )
    g.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="completions in flight at once, server-wide; beyond it a 429 with Retry-After "
        "(default: the ready ranks' total --max-num-seqs)",
    )
    g.add_argument(
        "--max-concurrent-requests-per-key",
        type=int,
        default=None,
        help="completions in flight at once per API key; beyond it a 429 (default: no limit)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        help=f"open HTTP connections; beyond it a 503 (default {defaults.max_connections})",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=defaults.header_timeout_s,
        help="seconds a connection may take to send a request's headers before it is "
        f"closed (default {defaults.header_timeout_s:g})",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=defaults.body_timeout_s,
        help=f"seconds a request body may take to arrive; then a 408 (default "
        f"{defaults.body_timeout_s:g})",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=int,
        default=defaults.keep_alive_timeout_s,
        help="seconds an idle keep-alive connection stays open between requests (default "
        f"{defaults.keep_alive_timeout_s})",
    )


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The :class:`RequestLimits` of parsed :func:`add_limit_args` flags (ValueError if bad)."""
    return RequestLimits(
        max_n=args.max_n,
        max_request_body_bytes=args.max_request_body_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        body_timeout_s=args.body_timeout,
    )
