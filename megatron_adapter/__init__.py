"""Megatron-core adapter (see README)."""
