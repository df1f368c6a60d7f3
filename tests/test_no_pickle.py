"""No bytes from another process are ever unpickled (issue 38). Object collectives
(``all_gather_object`` and kin) and ``pickle`` run code chosen by whoever wrote the bytes: a
peer rank, or anyone who can reach the store or a socket. The package gathers values only
(raw bytes, tensors, JSON). This test walks every module's syntax tree and fails on:

- an ``import pickle`` / ``cPickle`` / ``dill`` / ``marshal``;
- a call of ``pickle.loads``-like functions or of any object collective;
- ``torch.load`` without ``weights_only=True``.

The only allowed mentions are listed in ``LOCAL`` with the reason they read no peer's bytes."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "megatron_deadpool"

OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list"}
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "marshal", "cloudpickle"}

# module -> why its mentions read nobody else's bytes
LOCAL = {
    "adapters/quiet.py": "names Megatron's collectives to silence them on a promoted spare's "
                         "build thread; its stand-in copies this rank's own value and never "
                         "calls an object collective itself",
}


def findings(source: str):
    """(line, what) for each forbidden use in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            out += [(node.lineno, f"import {n}") for n in names
                    if n.split(".")[0] in PICKLERS]
            out += [(node.lineno, a.name) for a in node.names if a.name in OBJECT_COLLECTIVES]
        elif isinstance(node, ast.Attribute) and node.attr in OBJECT_COLLECTIVES:
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in OBJECT_COLLECTIVES:
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Constant) and node.value in OBJECT_COLLECTIVES:
            out.append((node.lineno, f"'{node.value}'"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "load" and getattr(node.func.value, "id", "") == "torch"):
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                       and k.value.value is True for k in node.keywords)
            if not safe:
                out.append((node.lineno, "torch.load without weights_only=True"))
    return out


def test_no_module_unpickles_what_another_process_wrote():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel in LOCAL:
            continue
        bad += [f"{rel}:{line}: {what}" for line, what in findings(path.read_text())]
    assert not bad, "value-only encodings instead:\n" + "\n".join(bad)


def test_local_exceptions_exist_and_are_still_needed():
    """An exception that no longer mentions anything is removed from the list."""
    for rel in LOCAL:
        assert findings((PKG / rel).read_text()), f"{rel} needs no exception any more"


def test_the_check_sees_each_form():
    """The walker can fail: each forbidden form is found in a sample."""
    sample = ("import pickle\nfrom dill import loads\nimport torch.distributed as dist\n"
              "dist.all_gather_object(o, x)\nfrom torch.distributed import gather_object\n"
              "torch.load(f)\ntorch.load(f, weights_only=False)\n"
              "torch.load(f, weights_only=True)\nname = 'broadcast_object_list'\n")
    found = [what for _, what in findings(sample)]
    assert "import pickle" in found and "import dill" in found
    assert found.count("all_gather_object") == 1 and "gather_object" in found
    assert found.count("torch.load without weights_only=True") == 2
    assert "'broadcast_object_list'" in found
