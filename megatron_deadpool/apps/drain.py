"""``deadpool drain --node N``: a planned swap of a running job, from any machine that
reaches its coordinator with the job's secret (DEADPOOL_TOKEN or DEADPOOL_TOKEN_FILE, the
same HMAC as every other message). The job moves node N's ranks to spares at the next
iteration boundary and redoes nothing (membership/drain.py). The command prints the
decider's answer; with ``--wait`` it also waits for the swap and prints the time from the
request to the slowest rank's first resumed step.

    deadpool drain --coordinator HOST:PORT --node 1 [--reason TEXT] [--to-standby] [--wait]

The coordinator's address is in the launcher's first lines ("coordinator HOST:PORT").
"""

from __future__ import annotations

import json
import time

from ..base.errors import ConfigError, DeadpoolError


def add_parser(sub) -> None:
    dp = sub.add_parser("drain", help="move a node's ranks to spares at the next iteration "
                        "boundary of a running job (a planned swap; needs the job's secret)")
    dp.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                    help="the job's coordinator (deadpool launch prints it at start)")
    dp.add_argument("--node", type=int, required=True, help="the node to drain")
    dp.add_argument("--reason", default="", help="free text recorded with the drain")
    dp.add_argument("--to-standby", action="store_true",
                    help="the drained node's slots stay in the job as standby spares")
    dp.add_argument("--wait", action="store_true",
                    help="wait for the swap and print how long it took")
    dp.add_argument("--timeout", type=float, default=120.0,
                    help="seconds to wait for the answer, and with --wait for the swap")


def run(args) -> int:
    from ..membership import auth
    from ..membership import store as st

    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--coordinator takes HOST:PORT, got {args.coordinator!r}")
    secret = auth.load_secret()
    try:
        coord = st.Coordinator(st.connect(host, int(port), args.timeout), secret)
        coord.check_secret(args.timeout)  # a wrong secret: refused here, nothing requested
        answer = coord.request_drain(args.timeout, node=args.node, reason="request",
                                     to_standby=bool(args.to_standby), text=args.reason)
    except (RuntimeError, OSError) as exc:  # torch's DistError family included
        raise DeadpoolError(f"no answer from the coordinator at {args.coordinator} (did the "
                            f"job end?): {type(exc).__name__}: {str(exc)[:200]}") from None
    if not answer.get("ok"):
        print(f"deadpool drain: refused: {answer.get('why')}; the job goes on untouched")
        return 1
    gen = answer["generation"]
    print(f"deadpool drain: node {args.node} is drained in generation {gen} at the next "
          "iteration boundary")
    if not args.wait:
        return 0
    done = _wait_for_reports(coord, gen, answer["world_size"], args.timeout)
    wall = max(r["t_done"] for r in done) - answer["t_request"]
    redone = max(r["iteration_at_failure"] - r["restored_iter"] for r in done
                 if r.get("iteration_at_failure") is not None)
    print(json.dumps({"generation": gen, "node": args.node,
                      "restored_iter": done[0]["restored_iter"], "iterations_redone": redone,
                      "request_to_first_step_s": round(wall, 3)}))
    return 0


def _wait_for_reports(coord, gen: int, world_size: int, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    while (done := coord.rank_records("report", gen, world_size)) is None:
        if time.monotonic() > deadline:
            raise DeadpoolError(f"the drain's generation {gen} did not finish its first "
                                f"step in {timeout_s:g}s")
        time.sleep(0.05)
    return done
