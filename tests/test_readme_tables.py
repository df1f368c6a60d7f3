"""The README can be skimmed (issue 52 item 6): every cell of its tables is one short line,
and the detail lives in docs/ behind a link that leads somewhere.

A cell is measured as a reader sees it: a link counts as its text, not its target, and an
escaped ``\\|`` as one character."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CELL_LIMIT = 120                                  # characters a cell may show
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)\)")
CELL_SEP = re.compile(r"(?<!\\)\|")


def table_cells(text):
    """(line number, cell) for every cell of every table row in ``text``."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            for cell in CELL_SEP.split(line.strip())[1:-1]:
                yield number, cell.strip()


def shown(cell):
    """The text a reader sees: links as their text, ``\\|`` as ``|``."""
    return LINK.sub(r"\1", cell).replace("\\|", "|")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc):
    """Every heading anchor of ``doc``, with GitHub's -1, -2 for repeated headings."""
    seen, out = {}, set()
    in_code = False
    for line in doc.read_text().splitlines():
        in_code ^= line.startswith("```")
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def too_long(text):
    return [(n, len(shown(c)), shown(c)) for n, c in table_cells(text)
            if len(shown(c)) > CELL_LIMIT]


def test_every_readme_table_cell_is_one_short_line():
    long = too_long(README.read_text())
    assert not long, "README table cells over %d characters (move the detail into docs/):\n%s" % (
        CELL_LIMIT, "\n".join(f"  line {n}: {size} chars: {cell[:80]}..." for n, size, cell in long))


def test_the_limit_catches_a_paragraph_in_a_cell():
    row = "| `--save`/`--load` | " + "a resume is bitwise, " * 10 + "([more](docs/features.md)) |"
    assert too_long(row) and not too_long("| `--save` | [more](docs/" + "x" * 200 + ".md) |")


def test_every_readme_link_into_the_repository_leads_somewhere():
    broken = []
    for text, target in LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target):
            continue                              # a URL outside the repository
        path, _, anchor = target.partition("#")
        doc = REPO / path
        if not doc.exists() or (anchor and anchor not in anchors(doc)):
            broken.append(target)
    assert not broken, f"README links that lead nowhere: {broken}"


def test_the_rows_that_other_tests_and_docs_name_are_kept():
    text, features = README.read_text(), (REPO / "docs" / "features.md").read_text()
    ft = next(line for line in features.splitlines()
              if line.startswith("| `--enable-ft-package`"))
    assert "tested bitwise" in ft                 # issue 50: a tested row, no longer refused
    assert "every commit" in {shown(c) for _, c in table_cells(text)}
    assert "refused" in {shown(c) for _, c in table_cells(features)}
    for heading in ("### Supported Megatron-LM tags", "## Status and compatibility"):
        assert heading in text, heading           # named by the code, the Makefile and docs/
    assert "**Refused with `--deadpool`.**" in features
    assert "### GPU extras" in (REPO / "docs" / "usage.md").read_text()


# the docs that show the demo's output: each block must be what the demo prints
DEMO_SHOWN = ("README.md", "docs/usage.md")


# what varies from run to run in the demo's output: numbers with a decimal point (times,
# losses), step times in ms, the slowest rank, the fingerprints; and the spacing
VARYING = re.compile(r"\d+\.\d+|\d+(?= ms)|(?<=on rank )\d+|[0-9a-f]{7}\.\.\.|\s+")


def demo_block(doc: Path) -> list:
    """The lines of ``doc``'s code block that ends with the demo's verdict (``bitwise_equal``),
    ``...`` (lines left out) and blank lines dropped."""
    block = next(b for b in re.findall(r"```[a-z]*\n(.*?)```", doc.read_text(), re.S)
                 if "bitwise_equal" in b)
    return [line.strip() for line in block.splitlines() if line.strip() not in ("", "...")]


# the one race the demo keeps: snapshot 11 commits while iteration 12 runs, so a kill that
# lands before that commit restores one iteration earlier and redoes one more
RESTORED = re.compile(r"(?<=restored iteration )\d+|\d+(?= iteration\(s\) redone)")


def pattern(line: str) -> str:
    """``line`` as a pattern: what varies (VARYING) matches anything of its kind; the
    iteration restored and the iterations redone as shown or one earlier and one more
    (RESTORED); every other number (iterations, ranks, spares) as shown."""
    out, at = [], 0
    for m in sorted([*VARYING.finditer(line), *RESTORED.finditer(line)], key=lambda m: m.start()):
        if m.re is RESTORED:
            n, one = int(m.group()), -1 if line[:m.start()].endswith("iteration ") else 1
            out += [re.escape(line[at:m.start()]), f"({n}|{n + one})"]
            at = m.end()
            continue
        tok = m.group()
        out += [re.escape(line[at:m.start()]), r"\s+" if tok.isspace() else
                r"[0-9a-f]+(\.\.\.)?" if tok.endswith("...") else r"[0-9.]+"]
        at = m.end()
    return "".join(out) + re.escape(line[at:])


def shown_in(printed: str, patterns: list) -> list:
    """The patterns not found in ``printed``'s lines, in order (each after the last match)."""
    lines, at, missing = printed.splitlines(), 0, []
    for pat in patterns:
        hit = next((i for i in range(at, len(lines)) if re.fullmatch(pat, lines[i].strip())),
                   None)
        if hit is None:
            missing.append(pat)
        else:
            at = hit + 1
    return missing


def test_the_shown_demo_check_catches_a_stale_line():
    """The check can fail: a block read as printed matches itself, and the same block with
    another iteration restored is caught."""
    for doc in DEMO_SHOWN:
        lines = demo_block(REPO / doc)
        pats = [pattern(line) for line in lines]
        assert any("restored" in line for line in lines), doc
        assert shown_in("\n".join(lines), pats) == [], doc
        stale = re.sub(r"restored iteration (\d+)", lambda m: f"restored iteration "
                       f"{int(m.group(1)) + 1}", "\n".join(lines))
        assert shown_in(stale, pats), doc  # tests/test_hotswap.py test_demo: the real run
