"""A standby spare does not poll the store for its plan (membership/member.py): it sleeps
until its watcher thread sees a newer generation. While no plan names it, its main
connection makes a few store operations per second, not two every PLAN_POLL_S (two standby
spares polling took CPU from training: docs/peers.md); a plan that names it still ends the
wait, and so does a stop."""

import threading
import time

from conftest import Counting
from megatron_deadpool.membership import member as mb
from megatron_deadpool.membership import store as st
from megatron_deadpool.base.plan import Plan

SECRET = "s" * 32


def _plan(gen, rank_of):
    return Plan(gen=gen, world_size=2, rank_of=rank_of, node_of_rank=(0, 1))


def _standby_spare(counted: bool):
    """A coordinator with generation 0's plan, and a spare (lid 2) whose watcher runs as
    admit() starts it; ``counted``: its main connection counts its store operations."""
    server = st.connect("127.0.0.1", 0, 30.0, is_master=True)
    coord = st.Coordinator(server, SECRET)
    coord.publish_plan(_plan(0, {0: 0, 1: 1}))
    spare = mb.Member(lid=2, node=1, host="127.0.0.1", port=server.port, secret=SECRET,
                      heartbeat_interval_s=0.1, rendezvous_timeout_s=5.0)
    if counted:
        spare.coord.raw = Counting(spare.coord.raw)
    spare._watcher = threading.Thread(target=spare._watch, daemon=True,
                                      args=(dict, lambda gen: None, lambda why: None))
    spare._watcher.start()
    coord.server = server  # kept alive with the coordinator
    return coord, spare


def test_a_standby_spare_blocks_in_the_store_until_a_plan_names_it():
    coord, spare = _standby_spare(counted=True)
    counting = spare.coord.raw
    got = []
    waiter = threading.Thread(target=lambda: got.append(spare.wait_for_plan(1, None)),
                              daemon=True)
    waiter.start()
    window_s = 1.0
    time.sleep(window_s)
    polls = window_s / mb.PLAN_POLL_S  # what a poll every PLAN_POLL_S would have made
    assert counting.n < polls / 5, counting.n  # about 2 operations per STANDBY_NAP_S
    coord.publish_plan(_plan(1, {0: 0, 3: 1}))  # a plan that takes another spare
    time.sleep(window_s)
    assert not got and counting.n < 2 * polls / 5, counting.n
    coord.publish_plan(_plan(2, {0: 0, 2: 1}))
    waiter.join(10)
    assert got and got[0].gen == 2 and got[0].rank(2) == 1
    spare.close()


def test_a_stop_ends_a_standby_spares_wait():
    coord, spare = _standby_spare(counted=False)
    ended = []

    def wait():
        try:
            spare.wait_for_plan(1, None)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            ended.append(exc)
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    coord.set_shutdown("complete: all ranks finished")
    waiter.join(10)
    assert ended and "complete" in str(ended[0]), ended
    spare.close()
