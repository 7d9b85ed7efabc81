"""Model runner, executor and sampler."""
