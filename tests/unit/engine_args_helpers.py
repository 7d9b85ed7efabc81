"""Engine argument values shared by the argv and EngineConfig tests."""

from __future__ import annotations

NULL_EXECUTOR = "corefleet.engine.worker.null_executor:NullExecutor"

# One non-default value per engine argument, keyed by its keyword (vLLM's EngineArgs name).
NON_DEFAULT: dict[str, object] = {
    "model": "/models/My Llama/llama-3.2-1b.Q8_0.gguf",
    "served_model_name": "team/llama-small",
    "max_model_len": 4096,
    "dtype": "bfloat16",
    "quantization": "none",
    "kv_cache_dtype": "float16",
    "seed": 1234,
    "runner": "pooling",
    "pooler_config": '{"pooling_type": "MEAN", "use_activation": false}',
    "max_logprobs": -1,
    "max_num_seqs": 7,
    "max_num_batched_tokens": 513,
    "enable_chunked_prefill": False,
    "scheduling_policy": "priority",
    "block_size": 32,
    "enable_prefix_caching": False,
    "kv_cache_memory": 123_456_789,
    "num_gpu_blocks_override": 64,
    "gpu_memory_utilization": 0.55,
    "device": "cpu",
    "attention_backend": "torch",
    "distributed_executor_backend": NULL_EXECUTOR,
    "enable_expert_parallel": True,
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 2,
}
