#!/usr/bin/env bash
# On the GPU machine (after prepare.sh here): install the kit, put the shim first on the path
# and run `kvstrata gpu-check --json`; its JSON (and stderr) land in $OUT (or /tmp).
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .device-kit/whl/*.whl || exit 3
xz -d -c .device-kit/vllm_C_stable_libtorch.so.xz > benchmarks/device/shim/vllm/_C_stable_libtorch.abi3.so
export PYTHONPATH=$PWD/benchmarks/device/shim:/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
timeout 480 python3 -m kvstrata.tools.gpu_check "$@" > "$OUT/gpu_check.json" 2> "$OUT/gpu_check.err"
echo "gpu_check exit $?"
cat "$OUT/gpu_check.json"
tail -20 "$OUT/gpu_check.err"
