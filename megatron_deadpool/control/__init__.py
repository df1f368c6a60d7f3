"""Control: one worker's runtime (``runtime.py``), the recovery's steps (``steps.py``), what
it protects for the job's life (``attachment.py``, ``holders.py``) and one generation's link
(``link.py``), sequencing the mechanisms below them. Used only through ``api.py``."""
