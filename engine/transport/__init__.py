"""How processes talk: ZMQ sockets, the msgpack codec, and the rank handshake.

``sockets`` makes every ZMQ socket (heartbeats, reconnect back-off, CURVE); ``serial`` encodes
the wire types with zero-copy array frames (never pickle); ``handshake`` is HELLO/INIT/READY
between a rank and whoever binds the sockets. Used by the engine process, its clients and the
coordinator alike; may import only ``messages`` and ``envs``.
"""
