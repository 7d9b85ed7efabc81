"""Paged attention and layer kernels behind one interface, ``backend.KernelBackend``.

``reference`` is the readable torch implementation (the base every backend falls back to),
``metadata`` the per-step attention metadata, ``backend`` the interface and its selection,
``flash_attn`` the flash-attn backend; ``cpu/`` holds C++ ops and ``triton_ops/`` Triton
kernels. Never imports ``corefleet.engine``.
"""
