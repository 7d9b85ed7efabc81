"""The OpenAI-compatible HTTP API on top of the coordinator.

``api_server`` builds the FastAPI app; ``admission`` checks keys, body size and in-flight
limits (``limits``) before anything is spent on a request; ``protocol`` holds the request
models and their validation, ``response_models`` the answers; ``serving`` turns a request into
engine requests and back, ``responses`` folds that into whole or streamed answers; ``openapi``
writes the ``/openapi.json`` document; ``errors``, ``logprobs`` and ``metrics`` (Prometheus:
``request_metrics`` per request, ``metrics_fleet`` from the ranks' stats) do what they say.
May import ``coordinator``, ``frontend`` and everything below; never torch.
"""
