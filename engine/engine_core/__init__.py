"""The engine core and the process that runs it.

``core.EngineCore`` is schedule -> execute -> update, one step at a time; ``proc.EngineCoreProc``
runs it behind two ZMQ IO threads (``io_threads``) with the drain/abort shutdown state machine;
``entry`` is the ``corefleet engine-core`` process (signals, health port, exit code),
``proc_config`` its settings, ``parent_watch`` the thread that ends it when its parent dies,
and ``health`` its liveness/readiness endpoints. May import ``worker``, ``models``, ``core``,
``transport`` and the base modules.
"""
