"""The scheduler's two loops over the running requests of a step, on the hot path of decoding.

:func:`schedule_decodes` hands each decoding request its next token and :func:`collect_outputs`
appends the token sampled for it. Both run for every request every step, so they work on locals
and bound methods, and take the common case (one token, nothing else to do) with as few
operations as possible. :class:`~corefleet.engine.core.scheduler.Scheduler` calls each once per
step and handles everything they leave to it.
"""

from __future__ import annotations

from collections.abc import Mapping

from corefleet.engine.core.kv_cache import KVCacheManager
from corefleet.engine.core.scheduler_output import CachedRequestData, ModelRunnerOutput
from corefleet.engine.core.stop import append_and_check, check_appended_token
from corefleet.engine.messages import EngineCoreOutput
from corefleet.engine.request import Request

# Shared by every request that gets no new block in a step (most decode steps): consumers only
# read it, and one shared list saves an allocation per request per step.
NO_BLOCKS: list[int] = []


def schedule_decodes(
    running: list[Request],
    req_index: int,
    token_budget: int,
    scheduled: CachedRequestData,
    num_scheduled: dict[str, int],
    kv: KVCacheManager,
    max_model_len: int,
) -> tuple[int, int]:
    """Schedule ``running[req_index:]`` while each is a plain decode that fits without preempting.

    A plain decode has one new token and a position left for the token it samples. Its blocks
    hold a slot for every computed token, so a token whose position is not 0 or 1 modulo the
    block size fits in them and completes no block: it needs nothing from the KV manager (14
    steps in 16 at block size 16). Otherwise it completes a block or needs a new one, which the
    manager's single-token path does; when no block is free the loop stops at that request.

    Returns the index of the first request not scheduled (``len(running)`` when all were) and
    the token budget left.
    """
    num_running = len(running)
    block_size = kv.block_size
    add_id, add_blocks = scheduled.req_ids.append, scheduled.new_block_ids.append
    add_computed = scheduled.num_computed_tokens.append
    while req_index < num_running and token_budget > 0:
        request = running[req_index]
        computed = request.num_computed_tokens
        position = computed + 1
        if len(request.all_token_ids) != position or position >= max_model_len:
            break
        if position % block_size > 1:
            new_block_ids = NO_BLOCKS
        else:
            allocated = kv.allocate_decode_slot(request, position)
            if allocated is None:
                break
            new_block_ids = allocated
        req_id = request.request_id
        add_id(req_id)
        add_blocks(new_block_ids)
        add_computed(computed)
        num_scheduled[req_id] = 1
        request.num_computed_tokens = position
        token_budget -= 1
        req_index += 1
    return req_index, token_budget


def collect_outputs(
    requests: Mapping[str, Request], model_runner_output: ModelRunnerOutput, max_model_len: int
) -> tuple[dict[int, list[EngineCoreOutput]], list[Request]]:
    """Append each request's sampled tokens and apply the stop rules.

    Returns the outputs per client index and the requests that stopped (still to be removed).
    Requests without new tokens (partial prefill) and unknown ones (finished while the model
    ran) get no output.
    """
    outputs: dict[int, list[EngineCoreOutput]] = {}
    stopped: list[Request] = []
    all_logprobs = model_runner_output.logprobs
    prompt_logprobs = model_runner_output.prompt_logprobs
    # One sampled token with nothing else to report.
    plain_decode = not all_logprobs and not prompt_logprobs
    client_index, client_outputs = -1, []  # the last client's list: usually the only one
    for req_id, generated in zip(
        model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
    ):
        if not generated:
            continue  # still prefilling
        request = requests.get(req_id)
        if request is None:
            continue  # finished (aborted) while the model ran
        if plain_decode and len(generated) == 1:
            # The hot loop: append the token and test, with one comparison and one set
            # lookup, whether anything else can happen (see Request.next_check_at).
            token = generated[0]
            request.output_token_ids.append(token)
            all_ids = request.all_token_ids
            all_ids.append(token)
            if len(all_ids) < request.next_check_at and token not in (request.stopping_token_ids):
                output = EngineCoreOutput(req_id, generated)
            else:
                output = check_appended_token(request, generated, max_model_len)
        else:
            output = append_and_check(request, generated, all_logprobs, max_model_len)
            output.new_prompt_logprobs = prompt_logprobs.get(req_id)
        if output.finish_reason is not None:
            stopped.append(request)
        if request.client_index != client_index:
            client_index = request.client_index
            client_outputs = outputs.setdefault(client_index, [])
        client_outputs.append(output)
    return outputs, stopped
