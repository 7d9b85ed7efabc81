"""Input and output processing, the offline LLM class."""
