"""``make_client(config, multiprocess, asyncio_mode)`` picks the client for a configuration:

============  ================  ================
..            sync              asyncio
============  ================  ================
in-process    ``InprocClient``  (none)
multiprocess  ``SyncMPClient``  ``AsyncMPClient``
============  ================  ================
"""

from __future__ import annotations

from corefleet.engine.client.base import AsyncEngineCoreClient, EngineCoreClient, MPClientOptions
from corefleet.engine.client.inproc import InprocClient
from corefleet.engine.client.mp import AsyncMPClient, SyncMPClient
from corefleet.engine.config import EngineConfig


def make_client(
    config: EngineConfig,
    multiprocess: bool = True,
    asyncio_mode: bool = False,
    options: MPClientOptions | None = None,
) -> EngineCoreClient | AsyncEngineCoreClient:
    """The client for this configuration (the module docstring's table)."""
    if not multiprocess:
        if asyncio_mode:
            raise ValueError("there is no in-process asyncio client; use multiprocess=True")
        return InprocClient(config)

    options = options or MPClientOptions()
    return AsyncMPClient(config, options) if asyncio_mode else SyncMPClient(config, options)
