"""The kopf operator: an ``InferenceEngine`` becomes per-rank engine pods and a coordinator.

Never imports torch, ZMQ, numpy or ``corefleet.engine`` (an import contract checks it): the
operator image is small, and everything it knows of the engine is its command line.
"""
