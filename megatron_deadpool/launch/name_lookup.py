"""A check at launch that the job's TCPStore connections will not wait on a name server.

torch's TCPStore client (2.13) looks up the server's address in reverse twice per connect
(``getnameinfo`` with ``NI_NUMERICSERV`` only), on the form it connects with: an IPv4
address as its IPv6 v4-mapped form (``::ffff:10.0.0.1``). A recovery opens its
generation's connections on every survivor at the same instant. Where ``/etc/hosts`` (or a
caching resolver) does not answer that form, the lookups reach the name server as a burst,
and one that drops some of them makes a connect wait the resolver's timeout: 5 s per
connection (a W = 32 recovery took 17.5 s against 9.1 s, docs/simulator.md). The launcher
times a few concurrent lookups on a background thread (the launch never waits for it) and
says what to add when one is slow.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Callable

SLOW_S = 0.5      # a lookup slower than this went to a name server that did not answer
CONCURRENT = 8    # a recovery's burst, in small


def torch_form(addr: str) -> str:
    """The address as torch's client socket sees its server: v4-mapped for IPv4."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:  # a name: torch resolves it, then looks the address up in reverse
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(addr))
        except OSError:
            return addr
    return f"::ffff:{ip}" if ip.version == 4 else str(ip)


def slowest_lookup_s(form: str, concurrent: int = CONCURRENT) -> float:
    """The slowest of ``concurrent`` reverse lookups of ``form`` (``torch_form``'s) made at
    once, as torch makes them (an error counts as its time: the resolver gave up)."""
    where = (form, 0, 0, 0)
    times = []

    def one() -> None:
        t = time.monotonic()
        try:
            socket.getnameinfo(where, socket.NI_NUMERICSERV)
        except OSError:
            pass
        times.append(time.monotonic() - t)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(concurrent)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return max(times)


def warn_if_slow(addr: str, say: Callable[[str], None]) -> threading.Thread:
    """In the background: ``say`` a warning if a reverse lookup of ``addr`` is slow."""
    def check() -> None:
        form = torch_form(addr)
        seconds = slowest_lookup_s(form)
        if seconds > SLOW_S:
            say(f"warning: a reverse name lookup of the coordinator's address ({form}) took "
                f"{seconds:.1f} s: torch makes two per TCPStore connection, and a recovery "
                f"opens its connections at once; add '{form} <name>' to /etc/hosts on every "
                f"node (or run a caching resolver)")

    th = threading.Thread(target=check, daemon=True, name="deadpool-name-lookup")
    th.start()
    return th
