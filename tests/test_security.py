"""Coordinator security: a client of the store without the job secret cannot publish a
plan, declare a process dead, stop the job or command an agent; replays are rejected; the
secret never enters the store."""

import dataclasses
import json

import pytest
import torch.distributed as dist

from megatron_deadpool.base.errors import TokenError
from megatron_deadpool.launch.agent import NodeAgent
from megatron_deadpool.membership import auth
from megatron_deadpool.membership import store as st
from megatron_deadpool.base.config import DeciderConfig
from megatron_deadpool.membership.decider import Decider, Proc
from megatron_deadpool.base.worker_env import WorkerEnv

SECRET = "the-job-secret"


def _job():
    store = dist.HashStore()
    procs = {r: Proc(lid=r, node=r // 2, role="active", rank=r) for r in range(4)}
    procs[4] = Proc(lid=4, node=2, role="spare")
    cmds = []
    d = Decider(store=store, procs=procs, world_size=4, token=SECRET,
                send_command=lambda node, cmd: cmds.append((node, cmd)),
                config=DeciderConfig(grace_s=0.0), log=lambda m: None)
    d.publish_initial_plan()
    member = st.Coordinator(store, SECRET)
    for lid in range(5):
        member.push_event("join", lid=lid, nonce=str(lid))
    d.step()
    return d, store, member, cmds


def test_secret_never_enters_the_store():
    d, store, member, _ = _job()
    keys = store.num_keys()
    dump = b"".join(store.get(k) for k in
                    [st.k("plan", 0), st.k("latest"), *[st.k("events", i) for i in range(1, 6)],
                     *[st.k("admit", i, str(i)) for i in range(5)]])
    assert SECRET.encode() not in dump and keys > 0


def test_foreign_client_cannot_publish_a_plan():
    d, store, member, _ = _job()
    forger = st.Coordinator(store, "guessed")
    plan = dataclasses.replace(member.get_plan(0), gen=1, failed_ranks=(0,))
    forger.publish_plan(plan)
    assert member.current_gen() == 0  # the forged pointer is ignored
    with pytest.raises(auth.AuthError):
        member.get_plan(1)
    # a genuine plan replayed into another generation's slot is rejected as well
    store.set(st.k("plan", 2), store.get(st.k("plan", 0)))
    with pytest.raises(auth.AuthError, match="replayed"):
        member.get_plan(2)


def test_foreign_client_cannot_declare_a_process_dead_or_stop_the_job():
    d, store, member, _ = _job()
    forger = st.Coordinator(store, "guessed")
    forger.push_event("exit", lid=1, code=-9, node=0)
    forger.push_event("fatal", lid=1, rank=1, error="forged")
    store.set(st.k("shutdown"), json.dumps({"body": {"reason": "forged"}, "mac": "0" * 64}))
    d.step()
    d.step()
    assert d.procs[1].state == "alive" and d.gen == 0 and not d.finished
    assert d.failed_reason is None and member.current_gen() == 0
    assert member.shutdown_reason() is None
    assert [e["claimed"]["kind"] for e in d.rejected] == ["exit", "fatal"]
    # a genuine event copied into a new slot is a replay: rejected too
    i = store.add(st.k("events", "n"), 1)
    store.set(st.k("events", i), store.get(st.k("events", 1)))
    d.step()
    assert len(d.rejected) == 3 and "replayed" in d.rejected[-1]["why"]


def test_foreign_client_cannot_command_an_agent(monkeypatch):
    store = dist.HashStore()
    agent = NodeAgent(0, [], ["true"], {}, WorkerEnv(), st.Coordinator(store, SECRET), {},
                      out=open("/dev/null", "w"))
    signals = []
    monkeypatch.setattr(agent, "signal", lambda lid, sig: signals.append((lid, sig)))
    st.Coordinator(store, "guessed").push_command(0, {"op": "signal", "signal": "SIGKILL",
                                                      "lids": [0]})
    st.Coordinator(store, SECRET).push_command(1, {"op": "signal", "signal": "SIGKILL",
                                                   "lids": [0]})  # for node 1
    # replay node 1's genuine command into node 0's queue
    i = store.add(st.k("cmd", 0, "n"), 1)
    store.set(st.k("cmd", 0, i), store.get(st.k("cmd", 1, 1)))
    agent._run_commands()
    assert signals == [] and agent.rejected_commands == 2
    st.Coordinator(store, SECRET).push_command(0, {"op": "signal", "signal": "SIGKILL",
                                                   "lids": [7]})
    agent._run_commands()
    assert [lid for lid, _ in signals] == [7]  # the job's own commands still work


def test_wrong_secret_is_refused_at_admission():
    d, store, member, _ = _job()
    import threading

    errors = []

    def join():
        try:
            st.Coordinator(store, "guessed").request_admission(3, timeout_s=5)
        except TokenError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=join)
    t.start()
    import time

    for _ in range(100):
        d.step()
        if not t.is_alive():
            break
        time.sleep(0.02)
    t.join()
    assert errors and "secret does not match" in errors[0]


def test_secret_file_must_be_private(tmp_path):
    f = tmp_path / "token"
    f.write_text("abc\n")
    f.chmod(0o644)
    with pytest.raises(auth.AuthError, match="chmod 600"):
        auth.load_secret({"DEADPOOL_TOKEN_FILE": str(f)})
    f.chmod(0o600)
    assert auth.load_secret({"DEADPOOL_TOKEN_FILE": str(f)}) == "abc"


@pytest.mark.parametrize("raw", [
    json.dumps({"body": {"kind": "exit", "lid": 1}, "mac": "\u00e9" * 64}),  # non-ASCII MAC
    json.dumps({"body": ["exit", 1], "mac": "0" * 64}),                      # not an object
    b"\xff\xfe not utf-8",
    json.dumps({"body": {"kind": "exit"}, "mac": None}),
    "[" * 100000 + "]" * 100000,                                              # RecursionError
    '{"body": ' + "[" * 100000 + "]" * 100000 + ', "mac": "0"}'])
def test_a_forged_byte_is_an_auth_error_never_a_crash(raw):
    """hmac.compare_digest raised TypeError on a non-ASCII MAC, which the store's readers
    (they catch AuthError) let through to the launcher's unguarded decider step."""
    with pytest.raises(auth.AuthError):
        auth.open_(SECRET, raw.encode() if isinstance(raw, str) else raw)


@pytest.mark.parametrize("forged", [
    json.dumps({"body": {"kind": "exit", "lid": 1, "code": -9}, "mac": "\u00e9" * 64}),
    '{"body": ' + "[" * 100000 + "]" * 100000 + ', "mac": "0"}'], ids=["non-ascii", "deep"])
def test_the_decider_steps_past_a_forged_event(forged):
    d, store, member, _ = _job()
    i = store.add(st.k("events", "n"), 1)
    store.set(st.k("events", i), forged)
    d.step()  # raised TypeError (non-ASCII MAC) and RecursionError (deep nesting) before
    assert d.procs[1].state == "alive" and d.gen == 0 and len(d.rejected) == 1
