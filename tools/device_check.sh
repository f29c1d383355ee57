#!/usr/bin/env bash
# One prepared check of wgpu-train on a lent GPU machine (run tools/device_prepare.sh here first): the
# carried loaders and wgpu, the adapters found, the kernel / GEMM / quantisation / engine tests (and the 16-bit
# ones) on every adapter there, `wgpu-train tune` of a 135M-shaped LoRA step, `wgpu-train bench --json` (and `--only serve`
# alone, its server on the carried starlette / uvicorn), a LoRA step of
# that configuration in fp32 / bf16 / f16 next to PyTorch + PEFT on CUDA in float32 and bf16 autocast
# (tools/gpu_vs_torch.py), and a training step at 0.5B
# scale (tools/smoke_large.py).
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
python3 -m pip install -q --no-index --find-links .whl wgpu rendercanvas cffi pycparser \
  starlette uvicorn anyio idna typing_extensions h11 click > "$OUT/pip.txt" 2>&1
export PYTHONPATH=$PWD XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
cli() { python3 -c 'import sys; from wgpu_train.cli.main import main; sys.exit(main(sys.argv[1:]))' "$@"; }

{ nvidia-smi -L; cli devices; } > "$OUT/devices.txt" 2>&1
cat "$OUT/devices.txt"
export XDG_CACHE_HOME=$OUT/cache
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gemm.py tests/test_gemm_tiled.py \
  tests/test_tune.py tests/test_quant.py tests/test_engine.py -k "not training_loss" > "$OUT/tests.txt" 2>&1
echo "tests: exit $?"; tail -3 "$OUT/tests.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_storage16.py tests/test_f16_arithmetic.py tests/test_precision_gpu.py -k "not phi3" \
  > "$OUT/tests16.txt" 2>&1
echo "16-bit tests: exit $?"; tail -3 "$OUT/tests16.txt"
mkdir -p "$OUT/smol135"
python3 -c 'import json, sys; from wgpu_train.bench.pretune import SMOL135; json.dump(SMOL135, open(sys.argv[1], "w"))' \
  "$OUT/smol135/config.json"
timeout 90 bash -c "$(declare -f cli); cli tune --model $OUT/smol135 --batch-size 4 --max-seq-len 256" \
  > "$OUT/tune.txt" 2> "$OUT/tune.err"
echo "tune: exit $?"; head -40 "$OUT/tune.txt"
timeout 90 bash -c "$(declare -f cli); cli bench --json" > "$OUT/bench.json" 2> "$OUT/bench.err"
echo "bench: exit $?"
timeout 90 bash -c "$(declare -f cli); cli bench --only serve --json" > "$OUT/bench_serve.json" 2> "$OUT/bench_serve.err"
echo "bench serve: exit $?"; tail -3 "$OUT/bench_serve.err"
timeout 90 python3 tools/gpu_vs_torch.py > "$OUT/vs_torch.json" 2> "$OUT/vs_torch.err"
echo "vs torch: exit $?"; cat "$OUT/vs_torch.json"
timeout 90 python3 tools/smoke_large.py > "$OUT/smoke.txt" 2>&1
echo "smoke: exit $?"; cat "$OUT/smoke.txt"
