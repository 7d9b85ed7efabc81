"""Model code and model files.

``llama`` is the torch model (Llama, Mistral, Qwen2); ``arch`` the architecture description;
``loader`` finds a model and reads its architecture, ``gguf_metadata`` and ``hf_loader`` read the
two formats' metadata (no torch: the coordinator reads them), ``weights`` and
``gguf_weights`` stream tensors. May import ``corefleet.kernels`` and the base modules.
"""
