"""Process entry points that assemble the layers below into a serving process.

``coordinator`` runs ``corefleet coordinator`` (HTTP API plus the fleet sockets, waiting for
ranks to dial in) and ``corefleet serve`` (the same with local rank processes). CPU-only: may
import ``openai``, ``coordinator``, ``frontend`` (tokenizer) and model metadata, never torch.
"""
