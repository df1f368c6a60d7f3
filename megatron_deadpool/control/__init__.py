"""Control: one worker's runtime (``runtime.py``) and what it protects (``protected.py``),
sequencing the mechanisms below them. Used only through ``api.py``."""
