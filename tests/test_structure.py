"""The package's shape, checked: one layer per folder (no module imports from a higher
layer), no import cycle between files or between folders (lazy imports inside functions
included: the whole syntax tree is walked, the folders' ``__init__.py`` files and imports by
name through ``importlib`` too), a map of every module in docs/architecture.md, thread clocks
read only by the meter, function size, and no reaching through two attributes from the top
layers. The layers are the ones docs/architecture.md draws: a module's layer is its folder's
(``FOLDERS``, the one list), so a new module in an existing folder needs no entry here.

The checks read the package under ``DEADPOOL_STRUCTURE_ROOT`` (a folder holding
``megatron_deadpool/`` and ``docs/architecture.md``) when it is set, this repository's
otherwise: tests/test_common_changes.py runs them on a changed copy.

Module size is a report, not a check: ``python tests/test_structure.py --sizes`` prints the
largest modules for docs/architecture.md's "Largest modules" section."""

import ast
import fnmatch
import os
import pathlib
import re
import sys
from typing import Dict, Iterable, List, Set

import pytest

ROOT = pathlib.Path(os.environ.get("DEADPOOL_STRUCTURE_ROOT")
                    or pathlib.Path(__file__).resolve().parent.parent)
PKG = ROOT / "megatron_deadpool"
DOC = ROOT / "docs" / "architecture.md"

# The layers, bottom to top: one per folder ("" is the package root: the api and the flags).
# A module may import from its own folder and the folders below it; its layer is its folder's.
FOLDERS = ["base", "membership", "mirror", "adapters", "recovery", "control", "", "megatron",
           "trainer", "launch", "apps"]
FOLDER_LAYER = {folder: i for i, folder in enumerate(FOLDERS)}
MAX_FUNCTION_LINES = 60


def _modules(inits: bool = False):
    """(name, path) of every module; with ``inits`` the folders' ``__init__.py`` too (named
    ``folder.__init__``: it belongs to its folder's layer, and its imports are checked)."""
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        if rel.name == "__init__" and not inits:
            continue
        yield ".".join(rel.parts), path


MODULES = dict(_modules())
ALL_FILES = dict(_modules(inits=True))  # the import checks read the __init__ files too


def _folder(name: str) -> str:
    return name.rpartition(".")[0]


def _layer(name: str):
    """A module's layer: its folder's (None for a folder with no layer)."""
    return FOLDER_LAYER.get(_folder(name))


def _shown(name: str) -> str:
    """A module or folder as the doc and the messages write it (``mirror/transport``)."""
    return name.replace(".", "/") or "(root)"


IMPORTERS = {"import_module", "importlib.import_module", "__import__"}
DYNAMIC = "<an import by a name the check cannot read>"


def _target(mod: str) -> str:
    """A package module, or a folder's ``__init__`` for an import of the folder itself."""
    init = f"{mod}.__init__" if mod else "__init__"
    return init if mod not in ALL_FILES and init in ALL_FILES else mod


def _absolute(text: str, pkg_parts: List[str], package=None):
    """The package-relative module a dotted name (``.x``, ``..y.z`` or absolute) names, or
    None for a module outside the package."""
    level = len(text) - len(text.lstrip("."))
    if not level:
        return text[len("megatron_deadpool."):] if text.startswith("megatron_deadpool.") \
            else "" if text == "megatron_deadpool" else None
    if package is not None:  # import_module(".x", "megatron_deadpool.mirror")
        pkg_parts = (_absolute(package, []) or "").split(".") if package != \
            "megatron_deadpool" else []
    base = pkg_parts[:len(pkg_parts) - level + 1]
    return ".".join(base + ([text.lstrip(".")] if text.lstrip(".") else []))


def _dynamic(node: ast.Call, pkg_parts: List[str]):
    """The package module an ``importlib.import_module(...)`` / ``__import__(...)`` call
    names (DYNAMIC when its name is not a literal), or None (not one, or outside)."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else \
        f"{getattr(func.value, 'id', '')}.{func.attr}" if isinstance(func, ast.Attribute) else ""
    if name not in IMPORTERS or not node.args:
        return None
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return DYNAMIC
    pkg = node.args[1] if len(node.args) > 1 else next(
        (k.value for k in node.keywords if k.arg == "package"), None)
    pkg = pkg.value if isinstance(pkg, ast.Constant) and isinstance(pkg.value, str) else None
    return _absolute(arg.value, pkg_parts, pkg)


def _imports(name: str, path: pathlib.Path):
    """Package modules imported anywhere in ``path`` (absolute and relative forms, at the
    top or inside a function, and by name through ``importlib.import_module`` or
    ``__import__``; DYNAMIC for a name that is not a literal)."""
    pkg_parts = name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = _absolute("." * node.level + (node.module or ""), pkg_parts)
            if mod is None:
                continue
            for alias in node.names:
                full = f"{mod}.{alias.name}" if mod else alias.name
                yield full if full in ALL_FILES else f"{full}.__init__" \
                    if f"{full}.__init__" in ALL_FILES else _target(mod)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                mod = _absolute(alias.name, pkg_parts)
                if mod:
                    yield _target(mod)
        elif isinstance(node, ast.Call):
            mod = _dynamic(node, pkg_parts)
            if mod is not None:
                yield mod if mod == DYNAMIC else _target(mod)


def _module_graph() -> Dict[str, Set[str]]:
    """Module -> the package modules it imports (itself left out)."""
    return {name: {t for t in _imports(name, path) if t in ALL_FILES and t != name}
            for name, path in ALL_FILES.items()}


def _folder_graph(modules: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """Folder -> the other folders its modules import from."""
    out: Dict[str, Set[str]] = {}
    for name, targets in modules.items():
        out.setdefault(_folder(name), set()).update(
            _folder(t) for t in targets if _folder(t) != _folder(name))
    return out


def _cycles(graph: Dict[str, Iterable[str]]) -> List[List[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one
    node (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_folder_is_a_layer():
    """The map is the folders: every module is in a folder of ``FOLDERS`` (its layer), and
    every folder listed holds modules."""
    unplaced = sorted({_shown(_folder(m)) for m in ALL_FILES} - {_shown(f) for f in FOLDERS})
    assert not unplaced, f"folders with no layer (list them in FOLDERS, " \
                         f"tests/test_structure.py): {unplaced}"
    empty = sorted(_shown(f) for f in FOLDERS if not any(_folder(m) == f for m in MODULES))
    assert not empty, f"layers with no module: {empty}"
    assert all(_layer(m) is not None for m in ALL_FILES)


def test_no_import_from_a_higher_layer():
    """Each folder is a layer: a module imports from its own folder and the folders below."""
    bad = []
    for name, targets in _module_graph().items():
        for target in targets:
            if None not in (_layer(name), _layer(target)) and _layer(target) > _layer(name):
                bad.append(f"{_shown(name)} imports {_shown(target)} "
                           f"({_shown(_folder(target))}/ is above {_shown(_folder(name))}/)")
    assert not bad, "\n".join(sorted(bad))


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself can fail: the mirror importing the runtime is caught."""
    fake = tmp_path / "mirror"
    fake.mkdir()
    (fake / "mirror.py").write_text("def f():\n    from ..control.runtime import Runtime\n")
    targets = list(_imports("mirror.mirror", fake / "mirror.py"))
    assert targets == ["control.runtime"]
    assert _layer(targets[0]) > _layer("mirror.mirror")


def test_every_import_names_its_module():
    """An ``importlib.import_module`` / ``__import__`` of a computed name would hide an
    import from the layer and cycle checks: every one names a literal module."""
    bad = [_shown(name) for name, path in ALL_FILES.items() if DYNAMIC in _imports(name, path)]
    assert not bad, f"imports by a computed name (the checks cannot follow them): {bad}"


def _planted(tmp_path, rel: str, text: str):
    """The package modules ``text`` imports, as if it were the file ``rel``."""
    f = tmp_path / rel.replace("/", "_")
    f.write_text(text)
    name = rel[:-len(".py")].replace("/", ".")
    return [t for t in _imports(name, f)]


def test_the_check_sees_a_back_import_in_an_init(tmp_path):
    """A folder's ``__init__.py`` is a module of its folder's layer: a back-import placed
    there is caught (issue 49), and so is an import of a higher folder's package itself."""
    for text in ("from ..control.runtime import Runtime\n", "from ..control import runtime\n",
                 "import megatron_deadpool.control.runtime\n", "from .. import control\n"):
        targets = _planted(tmp_path, "mirror/__init__.py", text)
        assert targets and all(_layer(t) > _layer("mirror.__init__") for t in targets), \
            (text, targets)
    assert "mirror.__init__" in ALL_FILES and "__init__" in ALL_FILES
    assert "mirror.__init__" in _module_graph()  # the checks walk the __init__ files


def test_the_check_sees_an_importlib_import(tmp_path):
    """An import by name is an import: ``importlib.import_module`` (absolute, or relative
    with a package) and ``__import__``, lazy inside a function; a computed name is
    reported as such."""
    planted = {
        'import importlib\ndef f():\n    importlib.import_module('
        '"megatron_deadpool.control.runtime")\n': ["control.runtime"],
        'from importlib import import_module\nimport_module("..control.runtime", '
        '"megatron_deadpool.mirror")\n': ["control.runtime"],
        'import importlib\nimportlib.import_module(".runtime", package=__package__)\n':
            ["mirror.runtime"],
        '__import__("megatron_deadpool.recovery.world")\n': ["recovery.world"],
        'import importlib\nimportlib.import_module(f"megatron_deadpool.{x}")\n': [DYNAMIC],
        'import importlib\nimportlib.import_module("json")\n': [],
    }
    for text, want in planted.items():
        assert _planted(tmp_path, "mirror/mirror.py", text) == want, (text, want)
    assert _layer("control.runtime") > _layer("mirror.mirror")


def test_no_file_import_cycle():
    """No module reaches itself through imports, lazy ones included (a registry imports its
    backends inside their factories; a backend imports the interface, never the registry)."""
    cycles = _cycles(_module_graph())
    assert not cycles, [[_shown(m) for m in c] for c in cycles]


def test_no_folder_import_cycle():
    cycles = _cycles(_folder_graph(_module_graph()))
    assert not cycles, [[_shown(f) for f in c] for c in cycles]


def test_the_cycle_check_sees_a_cycle(tmp_path):
    """The checker itself can fail: a lazy import back from a backend to its registry is a
    file cycle, and a folder pair importing each other is a folder cycle."""
    fake = tmp_path / "mirror"
    fake.mkdir()
    (fake / "registry.py").write_text("def make():\n    from .backend import B\n")
    (fake / "backend.py").write_text("from .registry import make\n")
    graph = {name: set(_imports(name, fake / f"{name.split('.')[1]}.py"))
             for name in ("mirror.registry", "mirror.backend")}
    assert _cycles(graph) == [["mirror.backend", "mirror.registry"]]
    assert _cycles({"a.x": {"b.y"}, "b.y": set(), "b.z": {"a.w"}, "a.w": set()}) == []
    assert _cycles(_folder_graph({"a.x": {"b.y"}, "b.y": set(), "b.z": {"a.w"},
                                  "a.w": set()})) == [["a", "b"]]


METER_ONLY = ("time.thread_time", "/proc/self/task", "thread_cpu_s")


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda x: str(x))
def test_thread_clocks_only_in_the_meter(name, path):
    """Measurement is an observer (mirror/meter.py): no other module reads thread clocks."""
    if name == "mirror.meter":
        return
    text = path.read_text()
    assert not [w for w in METER_ONLY if w in text], f"{name} reads thread clocks"


# Megatron knowledge lives in one folder tree each: megatron-core's in adapters/, Megatron-LM's
# in megatron/ (its hooks, its trees), and the reference trainer's own in trainer/.
MEGATRON_FOLDERS = ("adapters", "megatron", "trainer")


def _megatron_imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        yield from (n for n in names if n == "megatron" or n.startswith("megatron."))


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda x: str(x))
def test_megatron_is_imported_only_in_its_folders(name, path):
    """No module outside ``MEGATRON_FOLDERS`` imports megatron (lazy imports included)."""
    if name.split(".")[0] in MEGATRON_FOLDERS:
        return
    assert not list(_megatron_imports(path)), f"{name} imports megatron: use adapters/"


def test_the_megatron_check_sees_an_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from megatron.core import parallel_state\n")
    assert list(_megatron_imports(f)) == ["megatron.core"]


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda x: str(x))
def test_function_size(name, path):
    """Functions stay short; a module's size is reported (``--sizes``), not capped."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_FUNCTION_LINES, f"{name}.{node.name}: {n} lines"


# The mirror's classes stay small: a class that grows past this many public methods and
# properties (its own, a property's setter counted once) is split along a seam, as Mirror
# was (mirror/exchange.py: the per-generation buddy exchange; issue 52).
MAX_PUBLIC_MEMBERS = 12
SMALL_CLASS_FOLDERS = ("mirror",)


def _large_classes(path: pathlib.Path):
    """``Class: n public (names)`` for each class of ``path`` over ``MAX_PUBLIC_MEMBERS``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        public = sorted({f.name for f in node.body if isinstance(
            f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not f.name.startswith("_")})
        if len(public) > MAX_PUBLIC_MEMBERS:
            yield f"{node.name}: {len(public)} public {public}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _folder(n) in SMALL_CLASS_FOLDERS))
def test_mirror_classes_stay_small(name):
    assert not list(_large_classes(MODULES[name])), \
        f"{_shown(name)}: split along a seam (at most {MAX_PUBLIC_MEMBERS} public methods " \
        f"and properties): {list(_large_classes(MODULES[name]))}"


def test_the_class_size_check_sees_a_large_class(tmp_path):
    """The checker itself can fail: one method over the limit, a property with its setter
    counted once, private methods not counted."""
    f = tmp_path / "m.py"
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_PUBLIC_MEMBERS - 1))
    prop = ("    @property\n    def p(self):\n        return 1\n"
            "    @p.setter\n    def p(self, v):\n        pass\n"
            "    def _private(self):\n        pass\n")
    f.write_text(f"class Small:\n{methods}{prop}")
    assert list(_large_classes(f)) == []
    f.write_text(f"class Big:\n{methods}{prop}    def one_more(self):\n        pass\n")
    assert [c.split(":")[0] for c in _large_classes(f)] == ["Big"]
    assert "mirror.mirror" in MODULES and "mirror.exchange" in MODULES


# the package root (the api) and every module of control/, found, not listed by hand
REACH_CHECKED = sorted(name for name in MODULES if _folder(name) in ("", "control"))


def _reaches(path: pathlib.Path):
    """Attribute chains that read another object's attributes two dots deep: ``x.a.b`` on a
    local or ``self.a.b.c`` (imported modules and the frozen rank state, ``.state.``, which
    is handed down to be read, are not objects reached through)."""
    tree = ast.parse(path.read_text())
    modules = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    for node in ast.walk(tree):
        chain, n = [], node
        while isinstance(n, ast.Attribute):
            chain.append(n.attr)
            n = n.value
        if not chain or not isinstance(n, ast.Name) or n.id in modules:
            continue
        chain = [n.id] + chain[::-1]
        deep = len(chain) >= (4 if n.id == "self" else 3)
        if deep and "state" not in chain[1:-1]:
            yield f"{node.lineno}: {'.'.join(chain)}"


@pytest.mark.parametrize("name", REACH_CHECKED)
def test_no_reaching_through(name):
    """The api, the runtime and what it protects call each other's methods; none reads
    another object's attributes two dots deep (``rt.att.mirror``, ``self.att.mirror.x``)."""
    assert not sorted(set(_reaches(MODULES[name]))), sorted(set(_reaches(MODULES[name])))


def test_the_reach_check_sees_a_chain(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g(rt):\n    return rt.att.mirror\n")
    assert list(_reaches(f)) == ["2: rt.att.mirror"]
    assert "api" in REACH_CHECKED and "control.runtime" in REACH_CHECKED
    assert {n for n in MODULES if n.startswith("control.")} <= set(REACH_CHECKED)


def _doc_lists(name: str, doc: str) -> bool:
    """The doc's module table names ``name`` (``folder/module``), or a pattern of names that
    matches it (``mirror/*_transport``: the transport backends)."""
    listed = set(re.findall(r"`([\w/*]+)`", doc))
    return _shown(name) in listed or any(
        fnmatch.fnmatchcase(_shown(name), p) for p in listed if "*" in p)


def test_the_architecture_doc_maps_every_module():
    """docs/architecture.md's module table names every module (folder/name, or a pattern
    such as ``mirror/*_transport``)."""
    doc = DOC.read_text()
    missing = [name for name in MODULES if not _doc_lists(name, doc)]
    assert not missing, f"docs/architecture.md does not list: {missing}"


def test_the_doc_check_reads_patterns():
    doc = "| | `mirror/*_transport` | the backends |\n| | `base/config` | flags |"
    assert _doc_lists("mirror.rdma_transport", doc) and _doc_lists("base.config", doc)
    assert not _doc_lists("mirror.rdma", doc) and not _doc_lists("base.faults", doc)


SIZES_HEADING = "## Largest modules"


def sizes(top: int = 10) -> List[str]:
    """The ``top`` largest modules as the rows of the doc's table, largest first."""
    counts = sorted(((len(p.read_text().splitlines()), n) for n, p in MODULES.items()),
                    key=lambda c: (-c[0], c[1]))
    return [f"| `{_shown(n)}` | {lines} |" for lines, n in counts[:top]]


def test_the_largest_modules_are_reported():
    """docs/architecture.md has the "Largest modules" section and it names real modules
    (its numbers are a snapshot: regenerate with ``--sizes``, no test compares them)."""
    doc = DOC.read_text()
    assert SIZES_HEADING in doc, f"docs/architecture.md has no {SIZES_HEADING!r} section"
    section = doc.split(SIZES_HEADING, 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"^\| `([\w/]+)` \| \d+ \|$", section, re.M)
    assert len(named) >= 5, "the section's table lists no modules"
    gone = [m for m in named if m.replace("/", ".") not in MODULES]
    assert not gone, f"no such modules (regenerate: python tests/test_structure.py --sizes): " \
                     f"{gone}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--sizes"]:
        sys.exit("usage: python tests/test_structure.py --sizes")
    print("| module | lines |\n|---|---|\n" + "\n".join(sizes()))
