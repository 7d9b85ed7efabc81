"""The CPU backend: C++ ops built on first use with torch's cpp_extension.

``build`` compiles every op in ``csrc/`` into one extension; ``backend`` is the CPU backend that
calls them (paged attention over a step's new tokens, small-batch linear, fused layer ops, KV
writes, argmax) and falls back to the torch reference for what they do not cover.
"""
