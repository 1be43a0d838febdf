"""Rollout engines: the protocol, the built-in transformers engine, the SGLang adapter."""
