"""The fleet side of the coordinator: rank membership, routing, and the client of many ranks.

``server`` binds the handshake, input and output sockets; ``membership`` tracks which ranks are
ready, draining or dead; ``routing`` picks a rank per request (least-loaded, prefix-aware,
round-robin); ``fleet_client`` sends requests to ranks and re-routes or migrates them. Runs in a
CPU-only process: may import ``transport``, ``core`` (block hashes for prefix routing) and the
base modules, never torch, the kernels or the OpenAI layer above it.
"""
