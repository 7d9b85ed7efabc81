"""The Triton backend: paged attention, KV-cache writes, RMSNorm, rotary, SiLU and GGUF-quantized
matmuls in Triton.

``backend`` chooses between these kernels and the torch reference; ``support`` says whether
Triton can run here. Tested on CPU under Triton's interpreter.
"""
