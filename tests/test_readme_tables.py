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
    text = README.read_text()
    rows = {shown(c) for _, c in table_cells(text)}
    ft = next(line for line in text.splitlines() if line.startswith("| `--enable-ft-package`"))
    assert "tested bitwise" in ft                 # issue 50: a tested row, no longer refused
    assert {"refused", "every commit"} <= rows
    for heading in ("### Supported Megatron-LM tags", "## Status and compatibility",
                    "### GPU extras", "**Refused with `--deadpool`.**"):
        assert heading in text, heading           # named by the code, the Makefile and docs/
