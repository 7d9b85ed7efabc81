"""Turns a SchedulerOutput into one forward pass and one sampling call."""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
import torch

from corefleet.engine.config import EngineConfig
from corefleet.engine.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from corefleet.engine.models.arch import ArchConfig
from corefleet.engine.models.gguf_metadata import release_gguf_reader
from corefleet.engine.models.llama import KVCache, LlamaForCausalLM
from corefleet.engine.models.pipeline_parallel import PipelineStage
from corefleet.engine.models.rope import build_cos_sin_cache
from corefleet.engine.models.tensor_parallel import ShardPlan, TensorParallel
from corefleet.engine.models.weights import load_weights, quantized_weights
from corefleet.engine.pooler_config import resolve_runner
from corefleet.engine.worker.attention_inputs import AttentionInputs
from corefleet.engine.worker.dp_group import expert_parallel_for
from corefleet.engine.worker.dtypes import (
    DtypeChoice,
    choose_dtype,
    choose_kv_cache_dtype,
    describe_dtypes,
)
from corefleet.engine.worker.input_batch import InputBatch, RequestState, StepInputs
from corefleet.engine.worker.kv_allocation import allocate_kv_cache
from corefleet.engine.worker.kv_budget import WorkerMemory, cpu_kv_cache_budget
from corefleet.engine.worker.logit_masks import ban_stop_tokens_below_min_tokens, grammar_rows
from corefleet.engine.worker.pooler import Pooler
from corefleet.engine.worker.prompt_logprobs import PromptLogprobsTracker
from corefleet.engine.worker.sampler import Sampler, SamplingMetadata
from corefleet.kernels.backend_selection import select_kernel_backend
from corefleet.kernels.gguf_quant import QuantFormat
from corefleet.kernels.metadata import AttentionMetadata, PrefillSpan

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its KV cache and the per-request batch state on one device.

    Under tensor parallelism every worker runs one, on its slices of the model and of the KV
    cache (its KV heads); all of them sample, and worker 0's tokens are the step's. Under
    pipeline parallelism a stage runs its layers and passes the activations on; the last
    samples, and every stage takes the tokens to compute from the scheduler."""

    def __init__(
        self,
        config: EngineConfig,
        arch: ArchConfig,
        model_path: str,
        device: torch.device,
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
        stage: PipelineStage | None = None,
        memory: WorkerMemory | None = None,
    ) -> None:
        self.config = config
        self.memory = memory  # what this worker may use on CPU (None: unknown, or a GPU)
        self.arch = arch
        self.tp = tp or TensorParallel()
        self.stage = stage or PipelineStage()
        # This stage's layers: the KV cache has one entry per layer held.
        self.num_layers = len(self.stage.layers(arch.num_hidden_layers))
        self.shards = ShardPlan(arch, self.tp) if self.tp.enabled else None
        # This worker's KV heads: the cache holds only these.
        self.num_kv_heads = (self.shards.local_arch if self.shards else arch).num_key_value_heads
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        assert config.model.max_model_len is not None, "max_model_len must be resolved"
        self.max_model_len = config.model.max_model_len
        self.backend = select_kernel_backend(
            config.device.attention_backend, device, dtype=dtype, block_size=self.block_size
        )
        kv_choice = choose_kv_cache_dtype(config.cache.cache_dtype, dtype, self.backend.name)
        self.kv_dtype = kv_choice.dtype
        logger.info("%s", describe_dtypes(self._dtype_choice(), kv_choice))
        self.model: LlamaForCausalLM | None = None
        self.weights_bytes = 0  # this worker's parameters and buffers, once loaded
        self.kv_caches: list[KVCache] = []
        self.sampler = Sampler(argmax=self.backend.argmax)
        # A forward pass waiting for its grammar mask (structured outputs): its inputs, hidden.
        self._pending_sample: tuple[StepInputs, torch.Tensor] | None = None
        self._preempted_generators: dict[str, torch.Generator] = {}
        self.prompt_logprobs = PromptLogprobsTracker()
        self.pooler = Pooler() if resolve_runner(config.model.runner) == "pooling" else None
        self.batch = InputBatch(config.scheduler.max_num_seqs, self.max_model_len, self.block_size)
        self.attention_inputs = AttentionInputs(
            self.batch, self.backend.needs_block_tables, self.block_size, self._to_device
        )

    # ---- start-up -------------------------------------------------------------------------

    def _dtype_choice(self) -> DtypeChoice:
        """Why the model runs in ``self.dtype`` (the caller resolved it from the same inputs)."""
        choice = choose_dtype(self.config.model.dtype, self.arch.torch_dtype, self.device)
        return choice if choice.dtype == self.dtype else DtypeChoice(self.dtype, "given")

    def load_model(self) -> None:
        started = time.perf_counter()
        quantization = self.config.model.quantization
        if (self.tp.enabled or self.stage.enabled) and quantization == "auto":
            quantization = "none"  # the GGUF block kernels are not split: dequantize
        quantized = quantized_weights(self.model_path, quantization)
        with torch.device("meta"):
            model = LlamaForCausalLM(
                self.arch,
                self.backend,
                self.max_model_len,
                quantized,
                self.dtype,
                self.shards,
                self.stage,
                expert_parallel_for(self.config, self.device),  # its experts in an MoE group
            )
        model = model.to_empty(device=self.device).to(self.dtype)
        # The rotary table is computed, not loaded: rebuild it after materialising.
        model.register_buffer(
            "cos_sin_cache", _cos_sin(self.arch, self.max_model_len, self.device), persistent=False
        )
        model.tie_word_embeddings()
        model.load_weights(load_weights(self.model_path, self.dtype, bool(quantized)))
        self.model = model.eval()
        self.weights_bytes = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
        release_gguf_reader()  # a rank reads nothing more from the file
        logger.info(
            "loaded %s (%s, %d layers%s) in %.1f s",
            self.model_path,
            self.dtype,
            self.arch.num_hidden_layers,
            _describe_quantized(quantized),
            time.perf_counter() - started,
        )

    def kv_bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * a.head_dim * elem

    def determine_num_blocks(self) -> int:
        """Blocks that fit the KV budget: on CPU this worker's part of the rank's budget
        (``kv_budget.py``), a fraction of GPU memory after the model is loaded on CUDA."""
        cache = self.config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        if self.device.type == "cuda":
            _, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cache.gpu_memory_utilization) - self._profile_peak_memory()
        else:
            budget = cpu_kv_cache_budget(
                self.config, self.kv_bytes_per_block(), self.memory, self.weights_bytes
            )
        num_blocks = budget // self.kv_bytes_per_block()
        logger.info(
            "KV cache: %s, %d blocks of %d bytes (budget %d bytes%s)",
            str(self.kv_dtype).removeprefix("torch."),
            num_blocks,
            self.kv_bytes_per_block(),
            budget,
            "" if self.memory is None else f"; this rank may use {self.memory.describe()}",
        )
        if num_blocks < 2:
            memory = "" if self.memory is None else f" (this rank may use {self.memory.describe()})"
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds no block of "
                f"{self.kv_bytes_per_block()} bytes{memory}; raise --kv-cache-memory or "
                "--gpu-memory-utilization, or give the process more memory"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Peak GPU bytes of a forward pass over a full token budget, weights included
        (what must stay free besides the KV cache). Other processes' use counts too."""
        assert self.model is not None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        others = total - free_before - torch.cuda.memory_reserved(self.device)
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        self.initialize_kv_cache(2)  # every dummy token writes slot 0..; attention is causal
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            num_tokens=num_tokens,
            slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            num_decodes=0,
            decode_block_table=None,
            decode_mask=None,
            decode_context_lens=None,
            prefills=[PrefillSpan(0, num_tokens, num_tokens, None)],
            # One request whose every block is block 0, for block-table backends.
            block_tables=self._to_device(
                np.zeros((1, -(-num_tokens // self.block_size)), dtype=np.int32)
            ),
            seq_lens=self._to_device(np.array([num_tokens], dtype=np.int32)),
            query_start_loc=self._to_device(np.array([0, num_tokens], dtype=np.int32)),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        hidden = self._forward(ids, positions, meta, communicate=False)
        if hidden is not None:
            self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        return int(peak + others)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The cache, reading as zeros; on CPU committed as it is written (kv_allocation.py)."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.arch.head_dim)
        self.kv_caches = allocate_kv_cache(self.num_layers, shape, self.kv_dtype, self.device)

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step's forward pass and sample; None when the step has constrained requests:
        then :meth:`sample_tokens` samples once the engine has their grammar's mask."""
        if so.total_num_scheduled_tokens == 0:
            self._update_states(so)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs, meta = self.prepare_step(so)
        ids, positions = self._to_device(inputs.input_ids), self._to_device(inputs.positions)
        hidden = self._forward(ids, positions, meta)  # [T, H]
        if hidden is None:  # an earlier pipeline stage: the last one samples
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if self.pooler is not None:  # --runner pooling: vectors in place of tokens
            return self.pooler.output(inputs, hidden)
        if so.structured_output_req_ids and so.grammar is None:
            self._pending_sample = (inputs, hidden)
            return None
        return self._sample(inputs, hidden, so.grammar)

    def _forward(
        self,
        ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        communicate: bool = True,
    ) -> torch.Tensor | None:  # [T, H], or None on a pipeline stage before the last
        """The forward pass (this stage's part of it); without ``communicate`` a stage takes
        zeros for its input and sends nothing (memory profiling)."""
        assert self.model is not None, "load_model() first"
        stage = self.stage
        if not stage.enabled:
            return self.model(ids, positions, self.kv_caches, meta)
        carried = None
        if not stage.is_first:
            shape = (len(ids), self.arch.hidden_size)
            if communicate:
                carried = stage.recv(*shape, self.dtype, self.device)
            else:
                zeros = torch.zeros(shape, dtype=self.dtype, device=self.device)
                carried = (zeros, zeros.clone())
        hidden, residual = self.model.run_layers(ids, positions, self.kv_caches, meta, carried)
        if not stage.is_last:
            if communicate:
                stage.send(hidden, residual)
            return None
        return self.model.finish(hidden, residual)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput) -> ModelRunnerOutput:
        """Sample the step :meth:`execute_model` left waiting, under the grammar's mask."""
        assert self._pending_sample is not None, "execute_model() returned a step to sample"
        inputs, hidden = self._pending_sample
        self._pending_sample = None
        return self._sample(inputs, hidden, grammar)

    def prepare_step(self, so: SchedulerOutput) -> tuple[StepInputs, AttentionMetadata]:
        """Apply the scheduler's changes to the batch state and build this step's inputs."""
        self._update_states(so)
        inputs = self.batch.prepare(so.num_scheduled_tokens)
        return inputs, self.attention_inputs.metadata(inputs)

    def _update_states(self, so: SchedulerOutput) -> None:
        if self.pooler is not None:
            self.pooler.update(so)
        for req_id in so.preempted_req_ids:
            # A seeded request's random stream goes on where it stopped when it resumes (as
            # vLLM's): its tokens do not depend on whether it was preempted.
            state = self.batch.requests.get(req_id)
            if state is not None and state.generator is not None:
                self._preempted_generators[req_id] = state.generator
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.batch.remove(req_id)
            self.prompt_logprobs.drop(req_id)
        for req_id in so.finished_req_ids:
            self._preempted_generators.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = self._preempted_generators.pop(new.req_id, None)
            if generator is None and params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(params.seed)
            self.prompt_logprobs.start(new.req_id, params.prompt_logprobs, new.num_output_tokens)
            self.batch.add(
                new.req_id,
                new.token_ids,
                len(new.token_ids) - new.num_output_tokens,
                new.block_ids,
                new.num_computed_tokens,
                params,
                generator,
            )
        cached = so.scheduled_cached_reqs
        for req_id, start, token_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids, strict=False
        ):  # pipeline parallelism: the tokens to compute come from the scheduler
            self.batch.write_tokens(self.batch.requests[req_id].row, start, token_ids)
        if any(cached.new_block_ids):  # most decode steps give no request a new block
            requests = self.batch.requests
            grown = [(r, b) for r, b in zip(cached.req_ids, cached.new_block_ids, strict=True) if b]
            self.batch.append_blocks_to_rows(
                [requests[r].row for r, _ in grown], [b for _, b in grown]
            )

    def _sample(
        self, inputs: StepInputs, hidden: torch.Tensor, grammar: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        assert self.model is not None
        sampling_idx = np.flatnonzero(inputs.sample_mask)  # requests that produce a token
        last_token = np.cumsum(inputs.query_lens) - 1  # [B] row of each request's last token
        logits = self.model.compute_logits(
            hidden[self._to_device(last_token[sampling_idx])]
        )  # [N, V]
        states = [self.batch.requests[inputs.req_ids[i]] for i in sampling_idx]
        ban_stop_tokens_below_min_tokens(
            logits, states, self.batch.num_tokens, self.arch.eos_token_ids
        )
        history = _needs_history(states)
        meta = SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            generators=[s.generator for s in states],
            output_token_ids=[self.batch.output_token_ids(s) if history else [] for s in states],
            prompt_token_ids=[self.batch.prompt_token_ids(s) if history else [] for s in states],
            vocab_size=self.arch.vocab_size,
            device=self.device,
        )
        banned = None if grammar is None else grammar_rows(grammar, states, self.device)
        out = self.sampler(logits, meta, banned)
        sampled = out.sampled_token_ids
        if self.tp.enabled and not self.stage.enabled:  # the same tokens on every worker
            shared = torch.tensor(sampled, dtype=torch.long, device=self.device)
            sampled = self.tp.broadcast_from_first(shared).tolist()
        if not self.stage.enabled:  # else the scheduler sends them with the next step
            self.batch.append_tokens(inputs.rows[sampling_idx], np.asarray(sampled, dtype=np.int64))
        sampled_by_req: list[list[int]] = [[] for _ in inputs.req_ids]
        for k, i in enumerate(sampling_idx.tolist()):
            sampled_by_req[i] = [sampled[k]]
        logprobs = {states[k].req_id: row for k, row in enumerate(out.logprobs) if row is not None}
        prompt = self.prompt_logprobs.step(inputs, hidden, self.batch, self.model.compute_logits)
        return ModelRunnerOutput(inputs.req_ids, sampled_by_req, logprobs, prompt)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)


def _needs_history(states: list[RequestState]) -> bool:
    """Whether some row's sampling reads the tokens so far: penalties, and bad words (whose
    last token is banned after the rest of the word)."""
    return any(
        s.sampling_params.presence_penalty
        or s.sampling_params.frequency_penalty
        or s.sampling_params.repetition_penalty != 1.0
        or s.sampling_params.bad_words_token_ids
        for s in states
    )


def _cos_sin(arch: ArchConfig, max_positions: int, device: torch.device) -> torch.Tensor:
    table = build_cos_sin_cache(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
    return table.to(device)  # [max_positions, head_dim] float32


def _describe_quantized(quantized: dict[str, QuantFormat]) -> str:
    """`, 211 weights kept in GGUF blocks (Q4_1 210, Q8_0 1)` or nothing."""
    if not quantized:
        return ""
    counts = Counter(fmt.name for fmt in quantized.values())
    by_format = ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
    return f", {len(quantized)} weights kept in GGUF blocks ({by_format})"
