"""The coordinator: rank membership, load balancing and the OpenAI-compatible HTTP API."""
