import json
import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"',
                    Path("megatron_deadpool/__init__.py").read_text()).group(1)

# The supported Megatron-LM tags, each described once in patches/<tag>/ (COMMIT,
# files.sha256, tag.json; megatron_deadpool/adapters/tags.py reads them). The wheel ships
# that description as megatron_deadpool/patches/<tag>/ (an installed package has no patches/).
TAG_DATA = ["*/COMMIT", "*/files.sha256", "*/tag.json"]
TAGS = sorted((d for d in Path("patches").glob("core_v*") if (d / "COMMIT").is_file()),
              key=lambda d: tuple(int(n) for n in re.findall(r"\d+", d.name)))
if not TAGS:
    raise SystemExit("setup.py: no patches/core_v*/ (the Megatron-LM tags' descriptions)")


def _python(tag_dir):
    """The oldest Python the tag runs on (tag.json)."""
    about = json.loads((tag_dir / "tag.json").read_text())
    return tuple(int(n) for n in about["python"].split("."))


def megatron_core_pins():
    """On each Python, the megatron-core release of the newest tag that runs there
    (tag.json's "python"): core_v0.16.1's below 3.12, core_v0.19.0's from 3.12."""
    pins, upper = [], None  # upper: the oldest Python of the newer tags pinned so far
    for d in reversed(TAGS):  # newest first
        if upper is not None and _python(d) >= upper:
            continue  # a newer tag runs on all of this one's Pythons
        markers = []
        if d != TAGS[0]:  # the oldest tag's lower bound is python_requires
            markers.append(f"python_version >= '{'.'.join(map(str, _python(d)))}'")
        if upper is not None:
            markers.append(f"python_version < '{'.'.join(map(str, upper))}'")
        pin = f"megatron-core=={d.name[len('core_v'):]}"
        pins.insert(0, f"{pin}; {' and '.join(markers)}" if markers else pin)
        upper = _python(d)
    return pins


setup(
    name="megatron-deadpool",
    version=version,
    description="Hot-swap fault tolerance for Megatron-LM training: in-memory peer mirror "
                "of optimizer shards and spare processes that take over dead ranks",
    long_description=Path("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_deadpool", "megatron_deadpool.*"])
    + ["megatron_deadpool.patches"],
    package_dir={"megatron_deadpool.patches": "patches"},
    package_data={"megatron_deadpool.patches": TAG_DATA},
    # torch: install torch==2.13.0 first (a CPU build where pip has a local CPU wheel; PyPI
    # serves the CUDA build, which runs on CPU too).
    # crc32c: the snapshot checksum (CRC-32C in hardware, SSE4.2 / ARMv8; GIL released)
    # megatron-core: the reference trainer's and the demo's is 0.16.1 (Python 3.11, the local
    # CPU torch build); on 3.12, the environment of the core_v0.19.0 tests, 0.19.0
    # (megatron_core_pins).
    install_requires=["torch", *megatron_core_pins(), "numpy", "crc32c>=2.3"],
    extras_require={
        "test": ["pytest>=7", "matplotlib"],
        "report": ["matplotlib"],  # deadpool report
        # What Megatron-LM's own training code (pretrain_gpt.py, megatron/training) imports
        # beyond megatron-core; pybind11 builds its dataset helper when no prebuilt one fits;
        # psutil: the checkpoint writer (--save, torch_dist: dist_checkpointing's
        # filesystem_async worker processes).
        "megatron-lm": ["six", "regex", "pyyaml", "einops", "tqdm", "pydantic", "pybind11",
                        "triton", "psutil"],
        # apex is a source install: see docs/usage.md "GPU extras".
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["deadpool=megatron_deadpool.apps.cli:main"]},
)
