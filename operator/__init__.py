"""The kopf operator for InferenceEngine resources (never imports torch)."""
