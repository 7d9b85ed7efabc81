"""Clients of one engine core: what the offline ``LLM`` and the benchmarks talk to.

``base`` holds the client interfaces and ``EngineDeadError``; ``inproc`` steps an ``EngineCore``
in this process; ``mp`` runs it as a child process and talks ZMQ (sync and asyncio);
``launcher`` starts that child; ``factory.make_client`` picks one. May import ``engine_core``,
``transport`` and the base modules (``config``, ``messages``, ``envs``), nothing above.
"""
