"""Request bodies and a refusal check shared by the OpenAI protocol tests."""

from __future__ import annotations

from typing import Any

import pytest

from corefleet.engine.openai.errors import RequestError, parse_request
from corefleet.engine.openai.sampling_request import to_sampling_params

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def refused(kind: type, body: dict[str, Any] | str | bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        to_sampling_params(parse_request(kind, body))
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value
