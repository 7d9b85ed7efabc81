"""Stop rules and per-request outputs: what happens to a request after each sampled token."""

from __future__ import annotations

from corefleet.engine.messages import EngineCoreOutput, Logprobs
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


def check_appended_token(
    request: Request, token_ids: list[int], max_model_len: int
) -> EngineCoreOutput:
    """The full rules for one appended token the scheduler's fast path did not wave through
    (see ``Request.next_check_at``): hash a filled block, stop, report the first output."""
    if len(request.all_token_ids) >= request.next_full_block_at:
        request.next_full_block_at = request.hash_new_blocks()
    _move_next_check(request, max_model_len)
    if (
        token_ids[0] in request.stopping_token_ids
        or len(request.all_token_ids) >= request.next_check_at
        or len(request.output_token_ids) == 1
        or request.events
    ):  # it may stop, or it is the first output (cache hits), or events are due
        finished = check_stop(request, max_model_len)
        return make_output(request, token_ids, 1, finished, {})
    return EngineCoreOutput(request.request_id, token_ids)  # only a block filled


def append_and_check(
    request: Request,
    token_ids: list[int],
    all_logprobs: dict[str, Logprobs],
    max_model_len: int,
) -> EngineCoreOutput:
    """Several tokens, or tokens with logprobs: append them up to the first stop."""
    new_token_ids, finished = append_tokens(request, token_ids, max_model_len)
    _move_next_check(request, max_model_len)
    return make_output(request, new_token_ids, len(token_ids), finished, all_logprobs)


def _move_next_check(request: Request, max_model_len: int) -> None:
    request.next_check_at = min(request.next_full_block_at, request.length_limit, max_model_len)


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
        events=request.take_events(),
    )
