"""The package's shape, checked: the layering by module and by folder (no module imports
from a higher layer, lazy imports inside functions included), an explicit map of every
module, thread clocks read only by the meter, module size and function size. The layers are
the ones docs/architecture.md draws; a new module must be placed in one."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "megatron_deadpool"

# Bottom to top: each layer is a set of folders (the package root holds only the api), and
# every module is listed. A module may import from its own layer and the layers below it.
LAYERS = [
    ("foundations", {"base": ["errors", "vocabulary", "state", "faults", "config", "sections",
                              "worker_env", "planning", "scaling", "counts"]}),
    ("mechanisms", {
        "membership": ["auth", "assign", "plan", "procs", "local_restart", "startup", "records", "store",
                       "drain", "straggler", "decider", "member"],
        "mirror": ["placement", "snapshot", "transport", "rounds", "frames", "socket_transport", "handshake",
                   "metadata", "impostor", "threads", "d2h", "cost", "meter", "flat", "commit",
                   "held", "jobs", "mirror", "persist", "handoff"],
        "adapters": ["support", "shard", "extra_state", "train_state", "cpu_standins", "cpu_mode", "lm_rules",
                     "checkpoints", "iterators", "ddp", "training_globals", "tags",
                     "evaluation", "async_saves", "cadence"],
        "recovery": ["phases", "classify", "abort", "quiet", "reaper", "rebind", "restore",
                     "shared_groups", "stall", "world", "gloo_waits", "fault_points", "formation", "alarms",
                     "fallback", "boundary", "counting"]}),
    ("control", {"control": ["protected", "recovery", "runtime"]}),
    ("api", {"": ["api"]}),
    ("callers of the api", {"trainer": ["args", "data", "gpt"], "megatron": ["lm", "tree"]}),
    ("launch", {"launch": ["agent", "options", "fault_driver", "summary", "launcher", "child",
                           "progress", "slurm_drain"]}),
    ("applications", {"apps": ["demo", "soak", "bench", "bench_recovery", "bench_peers",
                               "peer_log", "peer_inject", "peer_systems", "report", "sim",
                               "sim_plot", "sim_peers", "sim_counts", "sim_measured",
                               "bench_units", "drain", "cli"]}),
]
FOLDER_LAYER = {folder: i for i, (_, folders) in enumerate(LAYERS) for folder in folders}
LAYER_OF = {(f"{folder}.{m}" if folder else m): i for i, (_, folders) in enumerate(LAYERS)
            for folder, mods in folders.items() for m in mods}
MAX_MODULE_LINES = 320
MAX_FUNCTION_LINES = 60


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        if rel.name == "__init__":
            continue
        yield ".".join(rel.parts), path


def _imports(name: str, path: pathlib.Path):
    """Package modules imported anywhere in ``path`` (absolute and relative forms)."""
    pkg_parts = name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[:len(pkg_parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("megatron_deadpool"):
                mod = node.module[len("megatron_deadpool."):]
            else:
                continue
            for alias in node.names:
                full = f"{mod}.{alias.name}" if mod else alias.name
                yield full if full in LAYER_OF else mod
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megatron_deadpool."):
                    yield alias.name[len("megatron_deadpool."):]


def test_every_module_has_a_layer():
    """The map is explicit: every module is listed, and every listed module exists."""
    names = {name for name, _ in _modules()}
    missing = sorted(names - set(LAYER_OF))
    assert not missing, f"place these modules in a layer (tests/test_structure.py): {missing}"
    assert not sorted(set(LAYER_OF) - names), "listed modules that do not exist"


def test_folders_are_layers():
    """Every folder (the package root too) belongs to exactly one layer, and so do all its
    modules: a folder never sits both below and above another."""
    for name, _ in _modules():
        folder = name.rpartition(".")[0]
        assert folder in FOLDER_LAYER, f"{name}: folder {folder or '(root)'!r} has no layer"
        assert LAYER_OF[name] == FOLDER_LAYER[folder], name
    uses = {}
    for name, path in _modules():
        for target in _imports(name, path):
            if target in LAYER_OF:
                uses.setdefault(name.rpartition(".")[0], set()).add(target.rpartition(".")[0])
    for folder, used in uses.items():
        for other in used:
            assert FOLDER_LAYER[other] <= FOLDER_LAYER[folder], f"{folder}/ imports {other}/"


METER_ONLY = ("time.thread_time", "/proc/self/task", "thread_cpu_s")


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda x: str(x))
def test_thread_clocks_only_in_the_meter(name, path):
    """Measurement is an observer (mirror/meter.py): no other module reads thread clocks."""
    if name == "mirror.meter":
        return
    text = path.read_text()
    assert not [w for w in METER_ONLY if w in text], f"{name} reads thread clocks"


def test_no_import_from_a_higher_layer():
    bad = []
    for name, path in _modules():
        for target in _imports(name, path):
            if target in LAYER_OF and LAYER_OF[target] > LAYER_OF[name]:
                bad.append(f"{name} ({LAYERS[LAYER_OF[name]][0]}) imports {target} "
                           f"({LAYERS[LAYER_OF[target]][0]})")
    assert not bad, "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself can fail: a mechanism importing the runtime is caught."""
    fake = tmp_path / "mirror"
    fake.mkdir()
    (fake / "mirror.py").write_text("from ..control.runtime import Runtime\n")
    targets = list(_imports("mirror.mirror", fake / "mirror.py"))
    assert targets == ["control.runtime"]
    assert LAYER_OF[targets[0]] > LAYER_OF["mirror.mirror"]


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda x: str(x))
def test_module_and_function_size(name, path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{name}: split it"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_FUNCTION_LINES, f"{name}.{node.name}: {n} lines"


REACH_CHECKED = ["api", "control.protected", "control.recovery", "control.runtime"]


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
    path = PKG / (name.replace(".", "/") + ".py")
    assert not sorted(set(_reaches(path))), sorted(set(_reaches(path)))


def test_the_reach_check_sees_a_chain(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g(rt):\n    return rt.att.mirror\n")
    assert list(_reaches(f)) == ["2: rt.att.mirror"]


def test_the_architecture_doc_maps_every_module():
    """docs/architecture.md's module table names every module (folder/name)."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    missing = [name for name, _ in _modules() if f"`{name.replace('.', '/')}`" not in doc]
    assert not missing, f"docs/architecture.md does not list: {missing}"
