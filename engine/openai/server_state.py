"""What the coordinator's HTTP handlers share: the fleet, the tokenizer, keys, limits, metrics,
how tool calls are read."""

from __future__ import annotations

from dataclasses import dataclass, field

from corefleet.engine.coordinator.fleet_client import FleetClient
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import ReadyResponse
from corefleet.engine.openai.admission import ApiKeys, InFlightLimiter
from corefleet.engine.openai.api_options import ApiOptions
from corefleet.engine.openai.errors import RequestError
from corefleet.engine.openai.limits import FALLBACK_MAX_N, RequestLimits
from corefleet.engine.openai.metrics import ServingMetrics
from corefleet.engine.openai.server_options import ServerOptions
from corefleet.engine.openai.structured_options import StructuredOutputsConfig
from corefleet.engine.openai.tool_options import ToolOptions


@dataclass
class ServerState:
    """What the HTTP handlers share: the fleet, the tokenizer, the keys and the limits."""

    fleet: FleetClient
    tokenizer: Tokenizer
    model_name: str
    api_keys: ApiKeys
    metrics: ServingMetrics
    limits: RequestLimits = field(default_factory=RequestLimits)
    tool_options: ToolOptions = field(default_factory=ToolOptions)
    options: ApiOptions = field(default_factory=ApiOptions)
    server: ServerOptions = field(default_factory=ServerOptions)  # --root-path, ...
    model_root: str = ""  # the model as --model named it (/v1/models' root)
    # --structured-outputs-config: strict JSON schemas or not
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    shutting_down: bool = False

    def __post_init__(self) -> None:
        template = self.options.chat.chat_template
        if template is not None:  # --chat-template: every chat form and /tokenizer_info use it
            self.tokenizer = self.tokenizer.with_chat_template(template)
        self.limiter = InFlightLimiter(
            self.max_concurrent, self.limits.max_concurrent_requests_per_key
        )
        self.metrics.watch_admission(self.limiter)

    def check_model(self, model: str | None) -> None:
        """404 ``model_not_found`` unless ``model`` is the served name (None: the served
        model, as vLLM and OpenAI's own default)."""
        if model is not None and model != self.model_name:
            raise RequestError(
                f"the model {model[:256]!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def engine_info(self) -> ReadyResponse:
        # A coordinator shutting down still serves what reaches it (its readiness sends new
        # clients elsewhere, and each response closes its connection): refusing would fail
        # requests that a rolling update must not fail.
        ranks = self.fleet.membership.accepting()
        if not ranks or ranks[0].info is None:
            raise RequestError(
                "no engine rank is ready yet; retry shortly", status=503, type="server_error"
            )
        return ranks[0].info

    def max_n(self) -> int:
        """The most completions one request may ask for now (``--max-n`` or the ranks')."""
        ranks = self.fleet.membership.accepting()
        info = ranks[0].info if ranks else None
        return self.limits.effective_max_n(info.max_num_seqs if info else None)

    def max_concurrent(self) -> int:
        """The server-wide bound on completions in flight, following the ready ranks."""
        total = sum(
            (m.info.max_num_seqs if m.info else 0) or FALLBACK_MAX_N
            for m in self.fleet.membership.accepting()
        )
        return self.limits.effective_max_concurrent(total or FALLBACK_MAX_N)
