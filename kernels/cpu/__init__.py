"""The CPU backend: C++ ops built ahead of time, one library per instruction-set variant.

``variants`` names the variants and holds every compiler flag (``setup.py`` builds them with the
package); ``loader`` loads the best one the CPU supports, ``jit`` compiles them now on a
developer's opt-in (``COREFLEET_CPU_OPS=jit``); ``backend`` is the CPU backend that
calls them (paged attention over a step's new tokens, small-batch linear, fused layer ops, KV
writes, argmax) and falls back to the torch reference for what they do not cover.
"""
