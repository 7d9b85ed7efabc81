"""The HTTP server's own options, under vLLM's flag names: ``--root-path``,
``--enable-tokenizer-info-endpoint``, ``--enable-server-load-tracking``.

``--root-path`` is FastAPI's ``root_path`` (vLLM sets ``app.root_path`` from it): the prefix a
path-based proxy adds in front of the API. A request is served whether the proxy strips the
prefix (``/v1/models``) or forwards it (``/PREFIX/v1/models``), as Starlette routes both, and
the OpenAPI document names the prefix in ``servers``. :func:`route_path` is that rule, applied
the same way by every layer that looks at a path: the key check, the coordinator's own HTTP
protocol (the generation POSTs) and FastAPI's routing, so that no layer reads a path another
routes differently (a prefixed ``/v1`` path must still need the key).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

# A path prefix: segments of URL path characters, no query, fragment, space or "..".
_ROOT_PATH = re.compile(r"(/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)+")
MAX_ROOT_PATH_CHARS = 256


@dataclass(frozen=True)
class ServerOptions:
    """The API server's options beyond limits and tools (vLLM's flags)."""

    root_path: str = ""  # "" or "/a/b": the proxy's prefix
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (off: 404, as vLLM)
    enable_server_load_tracking: bool = False  # GET /load counts requests (off: always 0)

    def __post_init__(self) -> None:
        root = self.root_path
        if root and (
            len(root) > MAX_ROOT_PATH_CHARS
            or not _ROOT_PATH.fullmatch(root)
            or any(part in (".", "..") for part in root.split("/"))
        ):
            raise ValueError(
                f"--root-path {root[:MAX_ROOT_PATH_CHARS]!r} must be empty or a URL path such "
                f"as /llm or /team/llm (no trailing slash, at most {MAX_ROOT_PATH_CHARS} "
                "characters)"
            )


def route_path(path: str, root_path: str) -> str:
    """The path a request is routed by: ``path`` without ``root_path`` when it starts with
    that prefix as whole segments (Starlette's ``get_route_path``), else ``path`` itself."""
    if not root_path or not path.startswith(root_path):
        return path
    rest = path[len(root_path) :]
    if not rest:
        return ""  # the prefix alone routes nowhere, as in Starlette
    return rest if rest.startswith("/") else path


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The flags of :class:`ServerOptions`, into the HTTP argument group's parser."""
    g = parser.add_argument_group("HTTP server (vLLM's flags; see docs/coordinator.md)")
    g.add_argument(
        "--root-path",
        default="",
        help="the path prefix of a path-based proxy in front of the API (FastAPI's root_path, "
        "e.g. /llm): requests are served with or without it, and /openapi.json names it",
    )
    g.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's configuration and chat template); "
        "off by default, as in vLLM",
    )
    g.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="GET /load counts the generation requests in flight; without it /load answers 0, "
        "as in vLLM",
    )


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    """The :class:`ServerOptions` of parsed :func:`add_server_args` flags (ValueError if bad)."""
    root = args.root_path.rstrip("/") if args.root_path else ""
    return ServerOptions(
        root_path=root,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_server_load_tracking=args.enable_server_load_tracking,
    )
