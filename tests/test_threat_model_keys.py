"""Issue 58: every store key a rank or an agent reads is in docs/threat-model.md's tables,
with its protection. The names are taken from the code: every literal first part of a
``membership.store.k(...)`` key, the barriers' and the rank records' names passed as
arguments, and the key constants of the mirror and of the keep votes. A key added to the
code and not to the table fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_deadpool"
DOC = (ROOT / "docs" / "threat-model.md").read_text()


def _sources():
    return {p: p.read_text() for p in PACKAGE.rglob("*.py")}


def code_keys():
    """The coordinator keys (``dp/<name>``) and the other keys' prefixes, from the code."""
    src = _sources()
    names = set()
    for text in src.values():
        names |= set(re.findall(r"\bk\(\s*\"([a-z_]+)\"", text))
        # rank records and barriers named by an argument: put_rank_record("report", ...)
        names |= set(re.findall(r"(?:rank_records?|put_rank_record)\(\s*\"([a-z_]+)\"", text))
        names |= set(re.findall(r"barrier(?::\s*str)?\s*=\s*\"([a-z_]+)\"", text))
    consts = set()
    for text in src.values():
        consts |= set(re.findall(r"^(?:KEY|PREFIX|[A-Z_]+_KEY)\s*=\s*\"([a-z][a-z/_-]*)\"",
                                 text, re.M))
    consts |= set(re.findall(r"prefix=\"([a-z]+/)\"", src[PACKAGE / "recovery" / "world.py"]))
    return {f"dp/{n}" for n in names}, consts


def test_every_key_the_code_reads_is_in_the_threat_models_tables():
    coordinator, others = code_keys()
    # the code's names are found (a broken pattern would make this test vacuous)
    assert {"dp/plan", "dp/node_store", "dp/report", "dp/boundary"} <= coordinator
    assert {"deadpool-mirror-socket/", "mirror/rounds/", "deadpool-run-id",
            "deadpool-mirror-rejected/", "repair/", "ready/", "arrived/"} <= others
    missing = sorted(k for k in coordinator if f"`{k}" not in DOC and f"{k}/" not in DOC)
    missing += sorted(k for k in others if k not in DOC)
    assert not missing, f"store keys not in docs/threat-model.md's tables: {missing}"
