"""Adapters that put FlatEP into the frameworks people run MoE models with.

Each adapter lives in its own module and imports its framework only there, so ``import flatep``
never needs the framework installed:

- :mod:`flatep.integrations.transformers`: ``shard_moe(model, group)`` makes the routed experts of a
  Hugging Face transformers model (Qwen3-MoE, DeepSeek-V3 / Kimi-K2, gpt-oss) expert-parallel
  (install with ``pip install flatep[transformers]``).
- :mod:`flatep.integrations.tiny_models`: tiny randomly initialised models of those families, built
  from their transformers configs without downloads (for tests, examples and benchmarks).
- :mod:`flatep.integrations.torchtitan`: ``apply_flatep(model, group, policy)`` makes the routed
  experts of a torchtitan MoE model (Qwen3-MoE, DeepSeek-V3) expert-parallel for training
  (install with ``pip install flatep[torchtitan]``).
- :mod:`flatep.integrations.tiny_torchtitan`: a tiny torchtitan Qwen3-MoE, synthetic data and a plain
  training loop that run on a CPU.
"""
