"""Signed coordinator messages. The job secret never enters the store: workers get it out
of band (``DEADPOOL_TOKEN`` in the environment, or ``DEADPOOL_TOKEN_FILE``, mode 0600).
Every plan, generation pointer, event (joins, exits, deaths, fatal errors), agent command,
worker and agent heartbeat, admission and shutdown is HMAC-SHA256-signed over canonical
JSON, and carries the slot it was written for (generation, event index, node and command
index, process id, request nonce), so a valid message copied to another slot or generation
is rejected. Replays into the same slot are stopped by the reader: events and commands are
read once, the generation pointer only grows, and a heartbeat counts only if its
(generation, sequence number) is newer than the last one taken (``procs.observe``).

Threat model: a client of the TCPStore without the secret can still delete or overwrite
keys (availability), and can change what is not signed: counters, the arrival barrier,
recovery timing reports, and torch.distributed's own rendezvous keys (``gen{g}/...``),
through which it could redirect the training communicators' connections. These messages
protect the control plane (who is dead, who takes which rank, when to stop), not the
training data; docs/threat-model.md lists every key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Optional

from ..base.errors import DeadpoolError


class AuthError(DeadpoolError):
    """A coordinator message is unsigned, badly signed, or signed for another slot."""


def load_secret(env=os.environ) -> str:
    """The job secret: DEADPOOL_TOKEN, else the first line of DEADPOOL_TOKEN_FILE (which
    must not be readable by group or others)."""
    if env.get("DEADPOOL_TOKEN"):
        return env["DEADPOOL_TOKEN"]
    path = env.get("DEADPOOL_TOKEN_FILE")
    if path:
        if os.stat(path).st_mode & 0o077:
            raise AuthError(f"{path} is readable by others: chmod 600 it")
        with open(path) as f:
            return f.readline().strip()
    raise AuthError("no job secret: set DEADPOOL_TOKEN or DEADPOOL_TOKEN_FILE "
                    "(deadpool launch does)")


def _mac(secret: str, body: Any) -> str:
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret.encode(), data, hashlib.sha256).hexdigest()


def seal(secret: str, body: dict) -> str:
    return json.dumps({"body": body, "mac": _mac(secret, body)})


def open_(secret: str, raw: Optional[bytes], **expect) -> dict:
    """The body of a sealed message, after checking its MAC and that every ``expect`` field
    has the expected value (the slot it was written for). Raises AuthError."""
    if raw is None:
        raise AuthError("missing message")
    try:
        msg = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        body, mac = msg["body"], msg["mac"]
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise AuthError("not a signed message") from None  # any bytes: an AuthError
    # compare_digest raises TypeError on a non-ASCII str: a forged byte must be an
    # AuthError like any other bad signature, never a crash of the reader
    if not isinstance(mac, str) or not isinstance(body, dict) or not mac.isascii() \
            or not hmac.compare_digest(mac, _mac(secret, body)):
        raise AuthError("bad signature")
    for key, want in expect.items():
        if body.get(key) != want:
            raise AuthError(f"signed for {key}={body.get(key)!r}, not {want!r} (replayed)")
    return body
