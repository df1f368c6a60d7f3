"""The package's shape, checked: the layering (no module imports from a higher layer, lazy
imports inside functions included), module size and function size. The layers are the ones
the README's "How it works" describes; a new module must be placed in one."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "megatron_deadpool"

# Bottom to top. A module may import from its own layer and the layers below it.
LAYERS = [
    ("foundations", ["errors", "faults", "config", "sections", "worker_env", "planning",
                     "scaling"]),
    ("mechanisms", ["membership.auth", "membership.assign", "membership.plan",
                    "membership.procs", "membership.local_restart", "membership.startup",
                    "membership.store", "mirror.placement", "mirror.snapshot",
                    "mirror.transport", "mirror.socket_transport", "mirror.handshake",
                    "mirror.metadata", "mirror.impostor", "mirror.threads", "mirror.d2h", "mirror.cpu", "mirror.flat",
                    "mirror.commit", "mirror.held",
                    "mirror.mirror", "mirror.persist", "megatron.support", "megatron.shard",
                    "megatron.train_state", "megatron.cpu_standins", "megatron.cpu_mode", "megatron.lm_rules",
                    "megatron.checkpoints", "megatron.iterators", "megatron.ddp", "megatron.training_globals", "megatron.tags",
                    "megatron.evaluation",
                    "recovery.phases", "recovery.classify", "recovery.abort", "recovery.quiet",
                    "recovery.reaper", "recovery.rebind", "recovery.restore",
                    "recovery.shared_groups", "recovery.stall", "recovery.world",
                    "recovery.fault_points"]),
    ("control", ["membership.decider", "membership.member", "recovery.formation",
                 "recovery.alarms", "recovery.fallback", "recovery.protected",
                 "recovery.runtime"]),
    ("api", ["api"]),
    ("callers of the api", ["trainer.args", "trainer.data", "trainer.gpt", "megatron.lm",
                            "megatron.tree"]),
    ("launch", ["launch.agent", "launch.options", "launch.fault_driver", "launch.summary",
                "launch.launcher", "launch.child", "launch.progress"]),
    ("applications", ["demo", "soak", "bench", "bench_recovery", "report", "sim", "sim_plot",
                      "cli"]),
]
LAYER_OF = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
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
    missing = [name for name, _ in _modules() if name not in LAYER_OF]
    assert not missing, f"place these modules in a layer (tests/test_structure.py): {missing}"


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
    (fake / "mirror.py").write_text("from ..recovery.runtime import Runtime\n")
    targets = list(_imports("mirror.mirror", fake / "mirror.py"))
    assert targets == ["recovery.runtime"]
    assert LAYER_OF[targets[0]] > LAYER_OF["mirror.mirror"]


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda x: str(x))
def test_module_and_function_size(name, path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{name}: split it"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_FUNCTION_LINES, f"{name}.{node.name}: {n} lines"
