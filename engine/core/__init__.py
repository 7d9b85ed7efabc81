"""Scheduling and KV-cache bookkeeping: the engine's decisions, in pure Python.

``scheduler`` does continuous batching and preemption; ``kv_cache``, ``block_pool`` and
``block_hash`` manage paged KV blocks with prefix caching; ``request_queue`` orders waiting
requests; ``stop`` applies stop rules; ``scheduler_output`` is what a step hands the worker. May
import only the base modules (``config``, ``request``, ``messages``): no torch, no models.
"""
