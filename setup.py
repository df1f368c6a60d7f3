import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"',
                    Path("megatron_deadpool/__init__.py").read_text()).group(1)

setup(
    name="megatron-deadpool",
    version=version,
    description="Hot-swap fault tolerance for Megatron-LM training: in-memory peer mirror "
                "of optimizer shards and spare processes that take over dead ranks",
    long_description=Path("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_deadpool", "megatron_deadpool.*"]),
    # torch: install torch==2.13.0 first (a CPU build where pip has a local CPU wheel; PyPI
    # serves the CUDA build, which runs on CPU too).
    # crc32c: the snapshot checksum (CRC-32C in hardware, SSE4.2 / ARMv8; GIL released)
    # megatron-core: the reference trainer's and the demo's is 0.16.1 (Python 3.11, the local
    # CPU torch build); on 3.12, the environment of the core_v0.19.0 tests, 0.19.0.
    install_requires=["torch", "megatron-core==0.16.1; python_version < '3.12'",
                      "megatron-core==0.19.0; python_version >= '3.12'", "numpy",
                      "crc32c>=2.3"],
    extras_require={
        "test": ["pytest>=7", "matplotlib"],
        "report": ["matplotlib"],  # deadpool report
        # What Megatron-LM's own training code (pretrain_gpt.py, megatron/training) imports
        # beyond megatron-core; pybind11 builds its dataset helper when no prebuilt one fits;
        # psutil: the checkpoint writer (--save, torch_dist: dist_checkpointing's
        # filesystem_async worker processes).
        "megatron-lm": ["six", "regex", "pyyaml", "einops", "tqdm", "pydantic", "pybind11",
                        "triton", "psutil"],
        # apex is a source install: see README "GPU extras".
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["deadpool=megatron_deadpool.apps.cli:main"]},
)
