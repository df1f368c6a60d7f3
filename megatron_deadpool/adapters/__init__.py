"""Megatron-core adapters the mechanism uses: the shard it mirrors, the state it captures,
the groups and caches it rebinds, the CPU stand-ins. Called by recovery and control, never
the other way round; the Megatron-LM entry hooks are in ``megatron/``."""
