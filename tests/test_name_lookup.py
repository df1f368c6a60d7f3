"""The launch's warning when a reverse lookup of the coordinator's address is slow
(launch/name_lookup.py): torch's TCPStore client makes two per connection, and a name
server that drops a recovery's burst of them made connections wait 5 s each."""

import socket
import time

from megatron_deadpool.launch import name_lookup


def test_the_form_looked_up_is_torchs_v4_mapped_one():
    assert name_lookup.torch_form("10.0.0.1") == "::ffff:10.0.0.1"
    assert name_lookup.torch_form("::1") == "::1"
    assert name_lookup.torch_form("localhost").startswith("::ffff:127.")


def test_a_slow_lookup_is_named_with_what_to_add(monkeypatch):
    asked = []

    def slow(where, flags):  # a resolver that gives up (here after 0.6 s, not 5 s)
        asked.append((where[0], flags))
        time.sleep(name_lookup.SLOW_S + 0.1)
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(name_lookup.socket, "getnameinfo", slow)
    said = []
    name_lookup.warn_if_slow("10.0.0.1", said.append).join(10)
    assert asked and all(a == ("::ffff:10.0.0.1", socket.NI_NUMERICSERV) for a in asked)
    assert len(said) == 1 and "'::ffff:10.0.0.1 <name>' to /etc/hosts" in said[0], said


def test_a_fast_lookup_says_nothing(monkeypatch):
    monkeypatch.setattr(name_lookup.socket, "getnameinfo", lambda where, flags: ("h", "0"))
    said = []
    name_lookup.warn_if_slow("10.0.0.1", said.append).join(10)
    assert said == []
