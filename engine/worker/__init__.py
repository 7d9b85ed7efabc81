"""Running the model for one step: the executor, the model runner and the sampler.

``executor`` defines the ``Executor`` interface and runs the model runner on a thread;
``null_executor`` runs no model (for measuring the rest); ``model_runner`` turns a scheduler
output into input tensors and sampled tokens, with ``input_batch`` holding per-request state and
``sampler``/``sampling_metadata`` doing the sampling. May import ``models``, ``core``
(``scheduler_output``), ``corefleet.kernels`` and the base modules.
"""
