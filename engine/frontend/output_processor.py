"""Engine outputs -> ``RequestOutput``s: detokenization, stop strings, logprobs, ``n`` > 1."""

from __future__ import annotations

from dataclasses import dataclass, field

from corefleet.engine.frontend.detokenizer import IncrementalDetokenizer, check_stop_strings
from corefleet.engine.frontend.outputs import CompletionOutput, RequestOutput, TokenLogprob
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import EngineCoreOutput, Logprobs, SamplingParams


@dataclass
class _SampleState:
    """One engine request: one completion of a user request."""

    parent: RequestOutput
    completion: CompletionOutput
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    full_text: str = ""  # text before stop-string truncation


@dataclass
class _ParentState:
    output: RequestOutput
    num_unfinished: int
    engine_ids: list[str] = field(default_factory=list)


class OutputProcessor:
    """Tracks every live request of one client and folds engine outputs into them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._samples: dict[str, _SampleState] = {}
        self._parents: dict[str, _ParentState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        engine_ids: list[str],
        params: SamplingParams,
    ) -> None:
        output = RequestOutput(
            request_id,
            prompt,
            prompt_token_ids,
            [CompletionOutput(i) for i in range(len(engine_ids))],
        )
        self._parents[request_id] = _ParentState(output, len(engine_ids), engine_ids)
        for i, engine_id in enumerate(engine_ids):
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            )
            self._samples[engine_id] = _SampleState(output, output.outputs[i], params, detok)

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def engine_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.engine_ids) if parent else []

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs; returns the requests that changed and the engine ids to
        abort (a stop string was found: the engine does not know about stop strings)."""
        changed: dict[str, RequestOutput] = {}
        to_abort: list[str] = []
        for out in outputs:
            sample = self._samples.get(out.request_id)
            if sample is None:
                continue  # aborted or finished earlier; late outputs are dropped
            stopped_by_string = self._apply(sample, out)
            if stopped_by_string and not out.finished:
                to_abort.append(out.request_id)
            if sample.completion.finished:
                self._finish_sample(out.request_id, sample)
            changed[sample.parent.request_id] = sample.parent
        return list(changed.values()), to_abort

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a user request as aborted; returns its final output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for engine_id in parent.engine_ids:
            sample = self._samples.get(engine_id)
            if sample is not None:
                sample.completion.finish_reason = "abort"
                self._finish_sample(engine_id, sample)
        return parent.output

    def _apply(self, sample: _SampleState, out: EngineCoreOutput) -> bool:
        completion, params = sample.completion, sample.params
        sample.parent.num_cached_tokens = max(
            sample.parent.num_cached_tokens, out.num_cached_tokens
        )
        if params.prompt_logprobs is not None and sample.parent.prompt_logprobs is None:
            # Every sample of a prompt scores the same prompt: the first to arrive serves.
            scored = out.new_prompt_logprobs
            rows = self._convert_logprobs(scored) if scored is not None else []
            sample.parent.prompt_logprobs = [None, *rows]
        completion.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            completion.logprobs = completion.logprobs or []
            completion.logprobs.extend(self._convert_logprobs(out.new_logprobs))
        delta = sample.detokenizer.add_tokens(out.new_token_ids)
        sample.full_text += delta
        if out.finished:
            sample.full_text += sample.detokenizer.flush()
        stop = (
            check_stop_strings(
                sample.full_text, len(delta), params.stop, params.include_stop_str_in_output
            )
            if params.stop
            else None
        )
        if stop is not None:
            stop_str, truncate_to = stop
            completion.text = sample.full_text[:truncate_to]
            completion.finish_reason, completion.stop_reason = "stop", stop_str
            return True
        completion.text = sample.full_text
        if out.finish_reason is not None:
            completion.finish_reason = str(out.finish_reason)
            completion.stop_reason = out.stop_reason
        return False

    def _finish_sample(self, engine_id: str, sample: _SampleState) -> None:
        del self._samples[engine_id]
        parent = self._parents[sample.parent.request_id]
        parent.num_unfinished -= 1
        if parent.num_unfinished == 0:
            parent.output.finished = True
            del self._parents[sample.parent.request_id]

    def _convert_logprobs(self, lp: Logprobs) -> list[dict[int, TokenLogprob]]:
        rows = []
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.sampled_ranks, strict=True):
            row: dict[int, TokenLogprob] = {}
            for j, (token_id, value) in enumerate(zip(ids, values, strict=True)):
                if token_id in row:
                    continue  # the sampled token can also be in the top-N
                token_rank = rank if j == 0 else j
                row[token_id] = TokenLogprob(value, token_rank, self.tokenizer.decode([token_id]))
            rows.append(row)
        return rows
