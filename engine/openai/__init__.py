"""The OpenAI-compatible HTTP API on top of the coordinator.

``api_server`` builds the FastAPI app; ``protocol`` holds the request and response models and
their validation; ``serving`` turns a request into engine requests and back; ``errors``,
``logprobs`` and ``metrics`` (Prometheus) do what they say. May import ``coordinator``,
``frontend`` and everything below; never torch.
"""
