"""The offline API: ``LLM(model).generate(prompts, params)``, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm import tqdm

from corefleet.engine.client.base import EngineCoreClient
from corefleet.engine.client.factory import make_client
from corefleet.engine.config import EngineConfig
from corefleet.engine.frontend.input_processor import InputProcessor, PromptType
from corefleet.engine.frontend.output_processor import OutputProcessor
from corefleet.engine.frontend.outputs import RequestOutput
from corefleet.engine.frontend.tokenizer import RESERVED_TEMPLATE_KWARGS, Tokenizer
from corefleet.engine.messages import SamplingParams, SchedulerStats
from corefleet.engine.models.loader import resolve_model_path

ChatMessages = list[dict[str, str]]


class LLM:
    """Batch generation, with the engine in a child process (default) or in this one.

    ``model`` is a Hugging Face folder, a GGUF file, or ``None`` for the embedded
    SmolLM2-135M-Instruct; other keyword arguments are engine arguments with vLLM's
    ``EngineArgs`` names, one per ``corefleet`` engine flag (``dtype``, ``max_model_len``,
    ``max_num_seqs``, ``scheduling_policy``, ``num_gpu_blocks_override``, ``kv_cache_memory``,
    ...; see ``corefleet.engine.config.ENGINE_ARGS``). An unknown one raises ``TypeError``
    naming it, before anything is loaded. ``multiprocess=False`` runs the engine in this
    process (no process hop, no isolation).
    """

    def __init__(
        self, model: str | None = None, multiprocess: bool = True, **engine_args: Any
    ) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        model_path = resolve_model_path(config.model.model)  # fail here, clearly, if missing
        client = make_client(config, multiprocess=multiprocess)
        assert isinstance(client, EngineCoreClient)
        self.engine_client = client
        info = client.engine_info
        self.tokenizer = Tokenizer.from_model_path(model_path)
        self.input_processor = InputProcessor(
            self.tokenizer, info.max_model_len, info.vocab_size, info.max_logprobs
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        Every prompt and parameter is validated before anything is queued, so a bad input
        raises ``ValueError`` and leaves the engine untouched.
        """
        prompt_list = _as_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError("priority must have one entry per prompt")

        pending = []
        for prompt, params, prio in zip(prompt_list, params_list, priorities, strict=True):
            processed = self.input_processor.process_prompt(prompt)
            request_id = str(next(self._ids))
            engine_requests = self.input_processor.make_requests(
                request_id, processed, params, prio
            )
            pending.append((request_id, processed, params, engine_requests))
        for request_id, processed, params, engine_requests in pending:
            self.output_processor.add_request(
                request_id,
                processed.prompt,
                processed.prompt_token_ids,
                [r.request_id for r in engine_requests],
                params,
            )
            for engine_request in engine_requests:
                self.engine_client.add_request(engine_request)
        return self._run([p[0] for p in pending], use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (``chat_template``, else the model's) to each conversation,
        then generate; vLLM's ``LLM.chat`` options.

        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` entries) go to the
        template, as in vLLM's ``LLM.chat``; reading calls out of the answers is the HTTP API's
        job (``--tool-call-parser``). ``chat_template_kwargs`` are more template variables
        (``enable_thinking``...); ``continue_final_message`` leaves the last message open for
        the model to continue it (``add_generation_prompt`` must then be false).

        Raises:
            ValueError: both prompt flags, a reserved name in ``chat_template_kwargs``
                (``messages``, ``tools``, ``chat_template``...), or a conversation the template
                refuses.
        """
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {reserved[0]!r}")
        if tools is not None:
            kwargs["tools"] = tools
        conversations = _as_conversations(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **kwargs,
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        num_generated = 0
        try:
            while self.output_processor.has_unfinished():
                engine_outputs = self.engine_client.get_output()
                num_generated += sum(len(o.new_token_ids) for o in engine_outputs.outputs)
                changed, to_abort = self.output_processor.process_outputs(engine_outputs.outputs)
                if to_abort:
                    self.engine_client.abort_requests(to_abort)
                for output in changed:
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
                if use_tqdm:
                    bar.set_postfix(output_tokens=num_generated, refresh=False)
        finally:
            bar.close()
        return [finished[r] for r in request_ids]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while requests hold blocks."""
        return bool(self.engine_client.call_utility("reset_prefix_cache"))

    def get_scheduler_stats(self) -> SchedulerStats:
        """Queue lengths, KV usage, prefix-cache and preemption counters of the engine."""
        stats = self.engine_client.call_utility("get_scheduler_stats")
        return msgspec.convert(stats, SchedulerStats)

    def shutdown(self) -> None:
        self.engine_client.shutdown()


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    return list(prompts)


def _as_conversations(messages: ChatMessages | Sequence[ChatMessages]) -> list[ChatMessages]:
    if messages and isinstance(messages[0], dict):
        return [messages]  # type: ignore[list-item]
    return list(messages)  # type: ignore[arg-type]


def _broadcast(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
