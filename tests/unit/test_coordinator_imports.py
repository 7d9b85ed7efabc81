"""The coordinator is a CPU-only process: serving the API must not load torch."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from corefleet.engine.entrypoints import coordinator as main
from corefleet.engine.models.loader import resolve_model_path
from corefleet.engine.frontend.tokenizer import Tokenizer

tokenizer = Tokenizer.from_model_path(resolve_model_path(None))
assert tokenizer.encode("hello"), "the tokenizer works"
print("torch" in sys.modules)
"""


def test_the_coordinator_and_its_tokenizer_never_import_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "the coordinator process imported torch"
