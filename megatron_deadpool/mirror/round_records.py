"""The signed records of the store rounds (rounds.py), and what the aggregating rank makes of
them. Pure: no store here.

    member record  m/{x}    {"k": "member", "g", "r", "w", "from": x, "posts", "adds",
                             "reads", "counts"}            written by rank x, read by rank 0
    result record  res/{x}  {"k": "result", "g", "r", "w", "to": x, "posts", "counts",
                   res/all   "forged"}                     written by rank 0, read by rank x

Each is sealed with the job secret (``membership/auth.py``: HMAC-SHA256 over canonical JSON)
and carries its slot: the generation ``g``, the round's number ``r`` and name ``w`` (commit,
gather, restore) and the rank it is from or for. A record that fails its MAC, or that is
signed for another slot (a genuine record copied to another rank's key, generation or round
name), is **forged**; a genuine record of an earlier round of the same generation (the keys
are reused round after round, so that a generation's keys do not grow with its steps) is
**stale**: its writer has not written this round's yet, or a forger put an old one back.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

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


def member(secret: str, gen: int, r: int, what: str, rank: int, posts: Mapping[str, Any],
           adds: Mapping[str, int], reads: Sequence[str], counts: Sequence[str]) -> str:
    return seal(secret, "member", gen, r, what, **{"from": rank}, posts=dict(posts),
                adds={k: int(v) for k, v in adds.items()}, reads=list(reads),
                counts=list(counts))


def results(members: Mapping[int, dict], forged: Mapping[int, str], world_size: int,
            shared: Optional[Tuple[Sequence[str], Sequence[str]]] = None
            ) -> Dict[Any, dict]:
    """What each member reads, from every genuine member record: ``{x: {"posts": {topic:
    [[poster, value], ...] by poster}, "counts": {counter: total}, "forged": {rank: why}}}``
    for each member x, or ``{"all": ...}`` when every member reads the same (``shared``:
    (topics, counters)). The records of ``forged`` ranks count for nothing; they are named
    in every result, and a member without a record gets one that names them."""
    posted: Dict[str, list] = {}
    totals: Dict[str, int] = {}
    for x in sorted(members):
        body = members[x]
        for topic, value in body.get("posts", {}).items():
            posted.setdefault(topic, []).append([x, value])
        for name, amount in body.get("adds", {}).items():
            totals[name] = totals.get(name, 0) + int(amount)
    named = {str(x): why for x, why in sorted(forged.items())}

    def one(reads: Iterable[str], counters: Iterable[str]) -> dict:
        return {"posts": {t: posted.get(t, []) for t in reads},
                "counts": {c: totals.get(c, 0) for c in counters}, "forged": named}

    if shared is not None:
        return {"all": one(*shared)}
    return {x: one(members[x].get("reads", ()), members[x].get("counts", ()))
            if x in members else one((), ()) for x in range(world_size)}


def forged_message(what: str, r: int, forged: Mapping[Any, str]) -> str:
    """The operator's line for the round's forged records."""
    ranks = ", ".join(f"rank {x}: {why}" for x, why in sorted(forged.items(), key=str))
    return (f"mirror {what} (round {r}): store records forged by someone without the job "
            f"secret ({ranks}); docs/threat-model.md")
