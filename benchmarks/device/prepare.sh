#!/usr/bin/env bash
# Here (with PyPI): fill .device-kit/ (git-ignored) with what run.sh needs on the GPU machine,
# which reaches no registry: wheels of kvstrata's dependencies for its Python (3.12) that its
# image lacks, and vLLM 0.32.0's compiled copy op from the vllm wheel, xz'd to fit the machine's
# 64 MiB transfer limit. Then: device run, carry [".device-kit"], command
# "bash benchmarks/device/run.sh".
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.device-kit
mkdir -p "$KIT/whl" /tmp/kvstrata-vllm-wheel
grep -qx "/$KIT/" .git/info/exclude 2>/dev/null || echo "/$KIT/" >> .git/info/exclude
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$KIT/whl" lmdb zstandard msgspec redis hiredis blake3
python3 -m pip download -q --no-deps "${PLAT[@]}" -d /tmp/kvstrata-vllm-wheel vllm==0.32.0
unzip -q -o -d /tmp/kvstrata-vllm-wheel /tmp/kvstrata-vllm-wheel/vllm-0.32.0-*.whl vllm/_C_stable_libtorch.abi3.so
xz -T0 -6 -c /tmp/kvstrata-vllm-wheel/vllm/_C_stable_libtorch.abi3.so > "$KIT/vllm_C_stable_libtorch.so.xz"
du -sh "$KIT"
