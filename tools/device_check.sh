#!/usr/bin/env bash
# One prepared check of wgpu-train on a lent GPU machine (run tools/device_prepare.sh here first): the
# carried loaders and wgpu, the adapters found, the kernel / GEMM / quantisation / engine tests on every
# adapter there, `wgpu-train bench --json`, and a training step at 0.5B scale (tools/smoke_large.py).
# Each part has its own time limit and writes its output under $OUT, so one failure does not hide the rest.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"

if ls .gl/*.deb >/dev/null 2>&1; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES=$icd
egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
[ -f "$egl" ] && export __EGL_VENDOR_LIBRARY_FILENAMES=$egl
python3 -m pip install -q --no-index --find-links .whl wgpu rendercanvas cffi pycparser > "$OUT/pip.txt" 2>&1
export PYTHONPATH=$PWD XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
cli() { python3 -c 'import sys; from wgpu_train.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }

{ nvidia-smi -L; cli devices; } > "$OUT/devices.txt" 2>&1
cat "$OUT/devices.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gemm.py tests/test_quant.py \
  tests/test_engine.py -k "not training_loss" > "$OUT/tests.txt" 2>&1
echo "tests: exit $?"; tail -3 "$OUT/tests.txt"
timeout 150 bash -c "$(declare -f cli); cli bench --json" > "$OUT/bench.json" 2> "$OUT/bench.err"
echo "bench: exit $?"
timeout 90 python3 tools/smoke_large.py > "$OUT/smoke.txt" 2>&1
echo "smoke: exit $?"; cat "$OUT/smoke.txt"
