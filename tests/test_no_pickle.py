"""No bytes from another process are ever unpickled (issue 38). Object collectives
(``all_gather_object`` and kin) and ``pickle`` run code chosen by whoever wrote the bytes: a
peer rank, or anyone who can reach the store or a socket. The package gathers values only
(raw bytes, tensors, JSON). This test walks the syntax tree of every module of the package
and of every script under ``scripts/``, and fails on:

- an ``import pickle`` / ``cPickle`` / ``dill`` / ``marshal`` / ``cloudpickle``, directly or
  by name (``importlib.import_module("pickle")``, ``__import__("pickle")``);
- a call of ``pickle.loads``-like functions, of any object collective, or of c10d's
  object helpers (``_tensor_to_object``, ``_object_to_tensor``);
- ``torch.load`` or ``torch.serialization.load`` without ``weights_only=True``, and
  ``from torch import load`` (a bare ``load`` the check could not see);
- ``np.load`` with ``allow_pickle`` other than ``False``;
- ``Connection.recv()`` (multiprocessing: a ``recv`` with no argument unpickles; a socket's
  ``recv(n)`` takes one).

The only allowed mentions are the lines listed in ``LOCAL``, each with the reason it reads no
peer's bytes (issue 49: the exemption is per line, not per file)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "megatron_deadpool"
SCRIPTS = ROOT / "scripts"

OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list",
                      # c10d's helpers under them: pickle.loads of a tensor's bytes
                      "_tensor_to_object", "_object_to_tensor"}
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "marshal", "cloudpickle"}
TORCH_LOADERS = {"torch.load", "torch.serialization.load", "serialization.load"}
NUMPY_LOADERS = {"np.load", "numpy.load"}
IMPORTERS = {"import_module", "importlib.import_module", "__import__"}

# (file, the stripped source line) -> why that line reads nobody else's bytes
QUIET_WHY = ("names Megatron's collectives to silence them on a promoted spare's build "
             "thread; its stand-in copies this rank's own value and never calls an object "
             "collective itself")
LOCAL = {
    ("megatron_deadpool/adapters/quiet.py", '"reduce", "all_gather_object", '
     '"broadcast_object_list")'): QUIET_WHY,
    ("megatron_deadpool/adapters/quiet.py", 'if name == "all_gather_object":'): QUIET_WHY,
}


def _dotted(node) -> str:
    """``a.b.c`` of a Name/Attribute chain, or ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id] + parts[::-1])


def _keyword(node: ast.Call, name: str):
    """The value node of keyword ``name``, or None."""
    return next((k.value for k in node.keywords if k.arg == name), None)


def _is_const(value, want) -> bool:
    return isinstance(value, ast.Constant) and value.value is want


def _imports(node):
    out = []
    names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
    out += [f"import {n}" for n in names if n.split(".")[0] in PICKLERS]
    out += [a.name for a in node.names if a.name in OBJECT_COLLECTIVES]
    if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
        out += [f"from {node.module} import load" for a in node.names if a.name == "load"]
    return out


def _call(node: ast.Call):
    name = _dotted(node.func)
    if name in IMPORTERS and node.args and isinstance(node.args[0], ast.Constant) \
            and str(node.args[0].value).split(".")[0] in PICKLERS:
        return [f"import_module({node.args[0].value!r})"]
    if name in TORCH_LOADERS and not _is_const(_keyword(node, "weights_only"), True):
        return ["torch.load without weights_only=True"]
    allow = _keyword(node, "allow_pickle")
    if name in NUMPY_LOADERS and allow is not None and not _is_const(allow, False):
        return ["np.load with allow_pickle"]
    if isinstance(node.func, ast.Attribute) and node.func.attr == "recv" \
            and not node.args and not node.keywords:
        return ["Connection.recv() (unpickles)"]
    return []


def findings(source: str):
    """(line, what) for each forbidden use in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [(node.lineno, what) for what in _imports(node)]
        elif isinstance(node, ast.Attribute) and node.attr in OBJECT_COLLECTIVES:
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in OBJECT_COLLECTIVES:
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Constant) and node.value in OBJECT_COLLECTIVES:
            out.append((node.lineno, f"'{node.value}'"))
        elif isinstance(node, ast.Call):
            out += [(node.lineno, what) for what in _call(node)]
    return out


def scanned():
    """Every file the check reads: the package's modules and the scripts."""
    return sorted(PKG.rglob("*.py")) + sorted(SCRIPTS.rglob("*.py"))


def unexempted(rel: str, source: str):
    """``findings`` of ``source`` (file ``rel``) less the lines ``LOCAL`` lists."""
    lines = source.splitlines()
    return [(line, what) for line, what in findings(source)
            if (rel, lines[line - 1].strip()) not in LOCAL]


def test_no_module_unpickles_what_another_process_wrote():
    bad = []
    for path in scanned():
        rel = path.relative_to(ROOT).as_posix()
        bad += [f"{rel}:{line}: {what}" for line, what in unexempted(rel, path.read_text())]
    assert not bad, "value-only encodings instead:\n" + "\n".join(bad)


def test_local_exceptions_exist_and_are_still_needed():
    """Each exempted line is still in its file and still mentions something."""
    for rel, text in LOCAL:
        source = (ROOT / rel).read_text()
        lines = source.splitlines()
        hit = [line for line, _ in findings(source) if lines[line - 1].strip() == text]
        assert hit, f"{rel}: {text!r} needs no exception any more"


def test_an_exempted_file_is_checked_outside_its_listed_lines():
    """The exemption is per line: a new mention elsewhere in an exempted file is found."""
    rel = "megatron_deadpool/adapters/quiet.py"
    source = (ROOT / rel).read_text()
    assert unexempted(rel, source) == []
    planted = source + "\n\ndef leak(o, x):\n    torch.distributed.all_gather_object(o, x)\n"
    assert [what for _, what in unexempted(rel, planted)] == ["all_gather_object"]


def test_the_scripts_are_scanned():
    """``scripts/`` is walked too: a script is code this project ships and runs."""
    names = {p.relative_to(ROOT).as_posix() for p in scanned()}
    assert "scripts/gpu_fp8_check.py" in names and "scripts/fault_matrix.py" in names


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


def test_the_check_sees_the_indirect_forms():
    """Each indirect way in is found in a planted sample: an import by name, ``load`` taken
    from torch, torch's serialization module, c10d's object helper, numpy's pickle switch and
    a multiprocessing connection's ``recv()`` (each unpickles)."""
    planted = {
        'import importlib\nm = importlib.import_module("pickle")\n': "import_module('pickle')",
        'from importlib import import_module\nimport_module("dill")\n': "import_module('dill')",
        'm = __import__("marshal")\n': "import_module('marshal')",
        "from torch import load\n": "from torch import load",
        "from torch.serialization import load\n": "from torch.serialization import load",
        "import torch\ntorch.serialization.load(f)\n": "torch.load without weights_only=True",
        "from torch import serialization\nserialization.load(f)\n":
            "torch.load without weights_only=True",
        "from torch.distributed import distributed_c10d as c10d\n"
        "obj = c10d._tensor_to_object(t, n, None)\n": "_tensor_to_object",
        "from torch.distributed.distributed_c10d import _tensor_to_object\n":
            "_tensor_to_object",
        "import numpy as np\nnp.load(f, allow_pickle=True)\n": "np.load with allow_pickle",
        "import numpy\nnumpy.load(f, allow_pickle=flag)\n": "np.load with allow_pickle",
        "from multiprocessing.connection import Client\nc = Client(a)\nmsg = c.recv()\n":
            "Connection.recv() (unpickles)",
    }
    for sample, want in planted.items():
        assert want in [what for _, what in findings(sample)], (sample, findings(sample))
    safe = ("import numpy as np\nnp.load(f)\nnp.load(f, allow_pickle=False)\n"
            "import torch\ntorch.serialization.load(f, weights_only=True)\n"
            "data = sock.recv(4096)\nconn.recv_bytes()\nimportlib.import_module('json')\n")
    assert findings(safe) == [], findings(safe)
