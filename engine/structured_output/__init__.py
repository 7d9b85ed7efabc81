"""Structured outputs: grammars that constrain what a request may generate (llguidance)."""
