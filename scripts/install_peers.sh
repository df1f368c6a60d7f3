#!/usr/bin/env bash
# Install the systems DeadPool is compared with (docs/peers.md, `deadpool bench peers`) into
# their own environment, and print the versions of everything installed:
#   nvidia-resiliency-ext (NVRx): ft_launcher, fault_tolerance, local checkpoints.
#   The relaunch baseline needs only torchrun, which comes with torch.
#
# usage: bash scripts/install_peers.sh            (makes .venv-peers beside the repository)
#   PEERS_VENV=DIR   where to put the environment (default: <repo>/.venv-peers)
#   PY312=CMD        the Python 3.12 to build it with (default: python3.12, else pyenv 3.12.1)
#   BASE_VENV=DIR    an environment with torch==2.13.0 and this package (default: .venv312,
#                    `make venv`); its packages are reused through a .pth file, so torch is
#                    not downloaded twice. Missing, torch and the package are installed here.
#   NVRX_VERSION=V   default 0.7.0
#
# NVRx 0.7.0's wheels are cp312/cp314 and tagged manylinux_2_39 (glibc >= 2.39); on an older
# glibc pip falls back to 0.4.1. The wheel's only compiled file is the CUPTI module that
# straggler detection loads (nothing else imports it), so on glibc < 2.39 the script fetches
# the wheel for its own platform and installs it under the generic linux_x86_64 tag.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${PEERS_VENV:-$repo/.venv-peers}
base=${BASE_VENV:-$repo/.venv312}
nvrx=${NVRX_VERSION:-0.7.0}

pick_python() {
    if [[ -n "${PY312:-}" ]]; then
        echo "$PY312"
    elif python3.12 --version >/dev/null 2>&1; then
        echo python3.12
    else
        echo "env PYENV_VERSION=3.12.1 python3.12"
    fi
}

glibc_at_least() {  # glibc_at_least 2 39
    local v
    v=$(ldd --version 2>/dev/null | head -n1 | grep -oE '[0-9]+\.[0-9]+$' || echo 0.0)
    local major=${v%.*} minor=${v#*.}
    ((major > $1 || (major == $1 && minor >= $2)))
}

make_venv() {
    local py
    py=$(pick_python)
    if [[ ! -x "$venv/bin/python" ]]; then
        # shellcheck disable=SC2086  # PY312 may be a command with arguments
        $py -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q -U pip
    if [[ -x "$base/bin/python" ]]; then
        local site
        site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$venv/bin/python" - "$site" <<'EOF'
import sys, sysconfig, pathlib
pth = pathlib.Path(sysconfig.get_paths()["purelib"]) / "_deadpool_base_venv.pth"
# addsitedir, not a bare path: the base's own .pth files (its editable install) run too
pth.write_text(f"import site; site.addsitedir({sys.argv[1]!r})\n")
EOF
        echo "reusing $base's packages (torch, megatron-core, megatron-deadpool)"
    else
        "$venv/bin/pip" install -q torch==2.13.0
        "$venv/bin/pip" install -q -e "${repo}[test,megatron-lm]"
    fi
}

install_nvrx() {
    local pip=("$venv/bin/pip")
    if glibc_at_least 2 39; then
        "${pip[@]}" install -q "nvidia-resiliency-ext==$nvrx"
        return
    fi
    local tmp
    tmp=$(mktemp -d)
    echo "glibc < 2.39: fetching the manylinux_2_39 wheel of NVRx $nvrx and installing it as linux_x86_64"
    "${pip[@]}" download -q --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 \
        --python-version 3.12 -d "$tmp" "nvidia-resiliency-ext==$nvrx"
    local whl generic
    whl=$(find "$tmp" -name "nvidia_resiliency_ext-$nvrx-*.whl" | head -n1)
    [[ -n "$whl" ]] || { echo "no NVRx $nvrx wheel was downloaded" >&2; exit 1; }
    generic=${whl/manylinux_2_39_x86_64/linux_x86_64}
    mv "$whl" "$generic"
    # its dependencies (pure Python, or wheels for any glibc) come from the index as usual
    "${pip[@]}" install -q "$generic"
    rm -rf "$tmp"
}

check() {
    "$venv/bin/python" -c 'import nvidia_resiliency_ext.fault_tolerance as ft; import megatron_deadpool, torch; print("fault_tolerance imports:", ft.__name__, "; torch", torch.__version__, "and megatron_deadpool import")'
    "$venv/bin/ft_launcher" --help >/dev/null
    echo "ft_launcher --help: ok"
    "$venv/bin/python" - <<'EOF'
from importlib.metadata import version, PackageNotFoundError
for name in ["nvidia-resiliency-ext", "torch", "megatron-core", "megatron-deadpool",
             "grpcio", "protobuf", "pydantic", "fastapi", "uvicorn", "httpx", "psutil"]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(f"{name}: not installed")
EOF
    "$venv/bin/python" --version
    ldd --version 2>/dev/null | head -n1
}

make_venv
install_nvrx
check
echo "peers installed in $venv"
