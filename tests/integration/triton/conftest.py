"""Triton kernels on CPU: set ``TRITON_INTERPRET=1`` before any corefleet Triton kernel is
imported.

``@triton.jit`` picks compiled or interpreted when the kernel module is imported, so the
variable has to be in the environment before that, and pytest imports this file before it
collects the tests next to it. An in-process run (rather than one subprocess per test file)
keeps pytest's parametrised reporting and costs no extra interpreter start-ups. The setting
stays for the rest of the session, which changes nothing for other tests: only Triton reads it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
