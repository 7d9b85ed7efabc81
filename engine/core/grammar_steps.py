"""The scheduler's part in structured outputs: admitting compiled grammars, advancing them.

A request with a grammar is queued as ``WAITING_FOR_FSM`` while its grammar compiles (the
engine's ``StructuredOutputManager`` pool); the scheduler asks :meth:`ConstrainedRequests.ready`
before admitting it and passes it over (keeping its place) until it is. After each step the
sampled token of every constrained request is fed to its matcher. Matchers are llguidance's,
used only through ``consume_tokens`` and ``get_error`` here, so this module imports neither it
nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from corefleet.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from corefleet.engine.messages import EngineCoreOutput, FinishReason
from corefleet.engine.request import Request, RequestStatus


class ConstrainedRequests:
    """What the scheduler tracks about grammars beyond each request's own matcher."""

    def __init__(self) -> None:
        self.num_constrained = 0  # unfinished requests with a compiled grammar (the fast gate)
        # Requests whose grammar failed to compile: (client index, error output), handed out
        # with the next step's outputs.
        self._failures: list[tuple[int, EngineCoreOutput]] = []

    def ready(self, request: Request) -> bool:
        """Whether ``request``'s grammar has compiled; it then becomes WAITING with its matcher.

        A grammar that failed finishes the request (FINISHED_ERROR, for the caller to free)
        with an error output naming the fault; it is not ready either.
        """
        future = request.grammar_future
        assert future is not None
        if not future.done():
            return False
        request.grammar_future = None
        error = future.exception()
        if error is None:
            request.matcher = future.result()
            request.status = RequestStatus.WAITING
            self.num_constrained += 1
            return True
        request.status = RequestStatus.FINISHED_ERROR
        failed = EngineCoreOutput(
            request.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=str(error)
        )
        self._failures.append((request.client_index, failed))
        return False

    def samplers(
        self, requests: Mapping[str, Request], num_scheduled: Mapping[str, int]
    ) -> list[str]:
        """The scheduled requests with a grammar that sample a token this step (their prompt
        is fully computed after it), in schedule order. Free unless a grammar is running."""
        if not self.num_constrained:
            return []
        return [
            req_id
            for req_id in num_scheduled
            if (r := requests[req_id]).matcher is not None
            and r.num_computed_tokens == len(r.all_token_ids)
        ]

    def advance(
        self,
        requests: Mapping[str, Request],
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        outputs: dict[int, list[EngineCoreOutput]],
    ) -> list[Request]:
        """Feed each constrained request's sampled token to its matcher.

        The token was sampled under the matcher's own mask, so it is accepted; a matcher that
        refuses it anyway (a backend fault) finishes its request with an error output rather
        than let it run on unconstrained. Returns those requests, for the caller to remove.
        """
        sampled = dict(
            zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True)
        )
        failed: list[Request] = []
        for req_id in scheduler_output.structured_output_req_ids:
            request = requests.get(req_id)
            tokens = sampled.get(req_id)
            if request is None or not tokens or request.matcher is None:
                continue  # finished (aborted) while the model ran
            if request.matcher.consume_tokens(tokens) or request.is_finished:
                continue
            message = f"the grammar refused token {tokens}: {request.matcher.get_error()}"
            request.status = RequestStatus.FINISHED_ERROR
            output = EngineCoreOutput(
                req_id, [], finish_reason=FinishReason.ERROR, stop_reason=message
            )
            outputs.setdefault(request.client_index, []).append(output)
            failed.append(request)
        return failed

    def hand_out_failures(self, outputs: dict[int, list[EngineCoreOutput]]) -> None:
        """Add the error outputs of grammars that failed to compile since the last step."""
        if self._failures:
            for client_index, failed in self._failures:
                outputs.setdefault(client_index, []).append(failed)
            self._failures = []
