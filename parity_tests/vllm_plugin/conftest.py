"""The vLLM plugin tests' fixtures (plugin_fixtures.py says how these tests run)."""

from plugin_fixtures import checkpoints, vllm  # noqa: F401  (fixtures pytest finds here)
