"""Megatron-LM entry hooks: what the patched ``pretrain_gpt.py`` calls (``lm.py``) and the
check of the patched tree (``tree.py``). Thin callers of ``api.py``."""
