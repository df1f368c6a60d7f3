"""Named sections of a rank's life, each with its own progress timeout (after NVRx's
``rank_section_timeouts``), and the ``--deadpool-section-timeouts`` syntax. Pure."""

from __future__ import annotations

import enum
from typing import Dict, Mapping

from .errors import ConfigError


class Section(str, enum.Enum):
    """A named phase of a rank's life with its own progress timeout (after NVRx's
    ``rank_section_timeouts``): a rank is hung when it makes no progress (a new iteration,
    or a section change) for its current section's timeout. STARTUP runs until the
    process's first step is done (imports, model build, pinned slots, warmup); STEP is the
    training loop; SAVE, EVAL and DATA are entered explicitly (``Deadpool.section``)."""

    STARTUP = "startup"
    STEP = "step"
    SAVE = "save"
    EVAL = "eval"
    DATA = "data"


# Sections that may run native code holding the GIL for long (a checkpoint's serialisation,
# Megatron's dataset index helpers, a model build): the heartbeat thread cannot run there,
# so a stale heartbeat is judged by the section's timeout, not the heartbeat timeout.
# (Values, not members: a str enum member hashes by its name, so "save" would not be found.)
GIL_SECTIONS = frozenset(s.value for s in (Section.STARTUP, Section.SAVE, Section.EVAL,
                                            Section.DATA))

# Sections in which one rank's local work may keep the others waiting in a collective for
# long: a checkpoint's writes and fsyncs (the save's closing barrier waits for the slowest
# writer), a dataset index build (the others wait at its barrier). On a gloo world their
# collectives are bounded by the section's timeout instead of the gloo op deadline
# (recovery/world.py, ``World.enter_section``). EVAL is not one: its steps are symmetric.
LOPSIDED_SECTIONS = frozenset(s.value for s in (Section.SAVE, Section.DATA))

# Default timeouts of the sections other than STEP (whose timeout is
# --deadpool-progress-timeout), in seconds.
SECTION_TIMEOUTS_S: Dict[str, float] = {Section.STARTUP.value: 1800.0,
                                        Section.SAVE.value: 1800.0,
                                        Section.EVAL.value: 1800.0,
                                        Section.DATA.value: 1800.0}


def parse_section_timeouts(text: str) -> Dict[str, float]:
    """``--deadpool-section-timeouts`` text (``save=3600,eval=900``) as {section: seconds};
    raises ConfigError (one line) on a bad item. STEP is --deadpool-progress-timeout."""
    out: Dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, val = item.partition("=")
        if not eq or name not in SECTION_TIMEOUTS_S:
            why = ("the step section's timeout is --deadpool-progress-timeout"
                   if name == Section.STEP.value else f"expected NAME=SECONDS with NAME one of "
                   f"{', '.join(SECTION_TIMEOUTS_S)}")
            raise ConfigError(f"bad --deadpool-section-timeouts item {item!r}: {why}")
        try:
            out[name] = float(val)
        except ValueError:
            raise ConfigError(f"bad --deadpool-section-timeouts item {item!r}: "
                              "SECONDS must be a number") from None
    return out


def checked_timeouts(given: Mapping[str, float], heartbeat_timeout_s: float
                     ) -> Dict[str, float]:
    """Every non-step section's timeout (defaults filled in), each checked to exceed the
    heartbeat timeout (soft < hard, as for the step section)."""
    unknown = sorted(set(given) - set(SECTION_TIMEOUTS_S))
    if unknown:
        raise ConfigError(f"--deadpool-section-timeouts: unknown section(s) {unknown} "
                          f"(sections: {', '.join(SECTION_TIMEOUTS_S)})")
    out = {**SECTION_TIMEOUTS_S, **given}
    for name, v in out.items():
        if not v > heartbeat_timeout_s:
            raise ConfigError(f"--deadpool-section-timeouts {name}={v:g} must be larger than "
                              f"--deadpool-heartbeat-timeout ({heartbeat_timeout_s:g})")
    return out


def checked_name(name: str) -> str:
    """``name`` if it names a section; raises ConfigError (one line) otherwise."""
    if name not in {s.value for s in Section}:
        raise ConfigError(f"unknown section {name!r} (sections: "
                          f"{', '.join(s.value for s in Section)})")
    return name


class SectionTracker:
    """The worker side: the section this rank is in, for its heartbeat (``status``). Outside
    any explicit section a rank is in STARTUP until its first step is done, then in STEP; a
    step marked before that is STARTUP too (the first step: pinned slots, warmup). Every
    change counts one entry (``section_n``), so the decider sees a save that began and ended
    between two of its polls as progress. The main thread writes, the heartbeat thread
    reads: the stack is an immutable tuple, swapped whole."""

    def __init__(self):
        self._stack: tuple = ()
        self._stepped = False
        self.entered = 0
        self.sent = 0  # the newest ``entered`` a heartbeat carried (the heartbeat thread)

    def current(self) -> str:
        stack = self._stack
        name = stack[-1] if stack else Section.STEP.value
        return Section.STARTUP.value if name == Section.STEP.value and not self._stepped \
            else name

    def enter(self, name: str) -> None:
        self._stack = self._stack + (checked_name(name),)
        self.entered += 1

    def leave(self) -> None:
        self._stack = self._stack[:-1]
        self.entered += 1

    def step_done(self) -> None:
        """This process finished a step: STARTUP is over."""
        if not self._stepped:
            self._stepped = True
            self.entered += 1

    def status(self) -> dict:
        """The heartbeat's fields: the section and how many entries came before it."""
        return {"section": self.current(), "section_n": self.entered}
