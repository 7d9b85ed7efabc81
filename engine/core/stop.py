"""Stop rules and per-request outputs: what happens to a request after each sampled token."""

from __future__ import annotations

from corefleet.engine.protocol import EngineCoreOutput, Logprobs
from corefleet.engine.request import Request, RequestStatus

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` stops after its last token; set its status if so.

    Order: ``min_tokens`` holds back EOS and stop-token stops, then EOS, then stop token ids
    (``stop_reason`` = the token), then the length limits. The length limits apply even below
    ``min_tokens``: nothing may run past ``max_model_len``.
    """
    num_output = len(request.output_token_ids)
    if num_output >= request.sampling_params.min_tokens:
        last = request.output_token_ids[-1]
        if last == request.eos_token_id:  # None when ignore_eos
            request.status = _STOPPED
            return True
        if last in request.stop_token_ids:
            request.status = _STOPPED
            request.stop_reason = last
            return True
    max_tokens = request.max_tokens
    if len(request.all_token_ids) >= max_model_len or (
        max_tokens is not None and num_output >= max_tokens
    ):
        request.status = _LENGTH_CAPPED
        return True
    return False


def append_tokens(
    request: Request, token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """Append several tokens, stopping at the first stop; the tokens after it are dropped."""
    for i, token_id in enumerate(token_ids):
        request.append_output_token_ids(token_id)
        if check_stop(request, max_model_len):
            return token_ids[: i + 1], True
    return token_ids, False


def make_output(
    request: Request,
    new_token_ids: list[int],
    num_sampled: int,
    finished: bool,
    all_logprobs: dict[str, Logprobs],
) -> EngineCoreOutput:
    """An output with more than tokens: a finish, logprobs or (first output) cache hits."""
    logprobs = all_logprobs.get(request.request_id)
    n = len(new_token_ids)
    if logprobs is not None and n < num_sampled:  # rows of the dropped tokens go too
        logprobs = Logprobs(
            logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.sampled_ranks[:n]
        )
    first = len(request.output_token_ids) == len(new_token_ids)
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_logprobs=logprobs,
        finish_reason=RequestStatus.finish_reason(request.status) if finished else None,
        stop_reason=request.stop_reason if finished else None,
        num_cached_tokens=max(request.num_cached_tokens, 0) if first else 0,
    )
