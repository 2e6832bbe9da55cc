"""Rank processes for tests/test_megatron*.py (launched by scripts/launch.py, gloo on CPU)."""
