"""Between users and the engine core: text in, text out.

``tokenizer`` and ``detokenizer`` (Hugging Face ``tokenizers`` or a GGUF vocabulary),
``chat_template`` (the model's Jinja template, sandboxed), ``input_processor`` (prompts and
sampling parameters into ``EngineCoreRequest``), ``output_processor`` and ``outputs`` (engine
outputs into ``RequestOutput``), and ``llm.LLM``, the offline API. May import ``client`` and
everything below it; the processors and the tokenizer are also used by the CPU-only
coordinator, so they never import torch.
"""
