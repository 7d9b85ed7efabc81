"""The OpenAI-compatible API: request and response models, validation, conversion."""
