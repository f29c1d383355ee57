#!/usr/bin/env bash
# Prepares, on this machine, what tools/device_check.sh needs on a lent GPU machine, which has no network:
# wgpu and its pure dependencies as wheels for that machine's Python 3.12 in .whl/, with the serve extra's
# (starlette, uvicorn and what they import: anyio, idna, typing_extensions, h11, click) for `bench --only serve`,
# at the versions installed here, and the Vulkan / EGL loader packages in .gl/ (both git-ignored). Then call the
# device tool's `run` with
#   carry [".whl", ".gl"] and command "bash tools/device_check.sh"   (timeout_s about 540).
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(python3 -c 'import wgpu; print(wgpu.__version__)')
# shellcheck disable=SC2207
serve=($(python3 -c 'from importlib.metadata import version as v
print(*(f"{p}=={v(p)}" for p in ("starlette", "uvicorn", "anyio", "idna", "typing_extensions", "h11", "click")))'))
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "wgpu==$version" rendercanvas cffi pycparser "${serve[@]}"

mkdir -p .gl /tmp/amd64/partial
apt_arch='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
# shellcheck disable=SC2086
apt-get $apt_arch update -qq
# shellcheck disable=SC2086
(cd .gl && apt-get $apt_arch download -qq libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
du -sh .whl .gl
