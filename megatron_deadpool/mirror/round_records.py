"""The signed records of the store rounds (rounds.py). Pure: no store here.

    up record    {r}/u/{x}  {"k": "up", "g", "r", "w", "from": x, "posts", "adds",
                             "reads", "counts", "forged"}  rank x's subtree's: written by
                                                           rank x, read by its parent
    down record  {r}/d/{x}  {"k": "down", "g", "r", "w", "to": x, "posts", "counts",
                             "forged"}                     what x's subtree reads: written
                                                           by x's parent, read by rank x

Each is sealed with the job secret (``membership/auth.py``: HMAC-SHA256 over canonical JSON)
and carries its slot: the generation ``g``, the round's number ``r`` and name ``w`` (commit,
gather, restore) and the rank it is from or for. A record that fails its MAC, or that is
signed for another slot (a genuine record copied to another rank's key, generation or round
name), is **forged**; a genuine record of an earlier round of the same generation (the keys
are per round, so only a forger can put one there) is **stale**.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

from ..membership import auth

STALE = "stale"


def seal(secret: str, kind: str, gen: int, r: int, what: str, **fields) -> str:
    return auth.seal(secret, {"k": kind, "g": gen, "r": r, "w": what, **fields})


def check(secret: str, raw: Optional[bytes], kind: str, gen: int, r: int, what: str,
          **slot) -> Tuple[Optional[dict], str]:
    """(body, "") for this round's record; (None, STALE) for a genuine one of an earlier
    round, or none yet; (None, why) for a forged one."""
    if raw is None:
        return None, STALE
    try:
        body = auth.open_(secret, raw, k=kind, g=gen, **slot)
    except auth.AuthError as exc:
        return None, str(exc)
    got = body.get("r")
    if isinstance(got, int) and not isinstance(got, bool) and got < r:
        return None, STALE
    if got != r or body.get("w") != what:
        return None, f"signed for round {got!r} ({body.get('w')!r}), not {r} ({what!r})"
    return body, ""


def forged_message(what: str, r: int, forged: Mapping[Any, str]) -> str:
    """The operator's line for the round's forged records."""
    ranks = ", ".join(f"rank {x}: {why}" for x, why in sorted(forged.items(), key=str))
    return (f"mirror {what} (round {r}): store records forged by someone without the job "
            f"secret ({ranks}); docs/threat-model.md")
