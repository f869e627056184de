#!/usr/bin/env bash
# On the GPU machine: run.sh once in full, then the stager section alone for each
# "descriptors-per-call pace-depth [more gpu-check options]" given (default: a small sweep);
# prints one line per run of the figures that decide the stager's defaults. Everything also
# lands under $OUT.
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp}
pip list 2>/dev/null | grep -iE "^(vllm|torch|triton) " || true
python3 -c "import vllm" 2>&1 | tail -1
summary() {
    python3 - "$1" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["stager"]
except Exception as e:  # noqa: BLE001 - a summary line, never a traceback
    print("no stager figures:", e); sys.exit()
keys = ("descriptors_per_call", "pace_depth", "launch_hold_s", "store_vs_copy", "load_vs_copy",
        "store_submit_ms", "load_submit_ms", "step_ms_alone", "step_with_job_vs_alone",
        "step_with_job_unheld_vs_alone", "job_ms_store_load", "job_ms_store_load_unheld",
        "graph_step_ms_alone", "graph_step_with_job_vs_alone",
        "graph_step_with_job_unheld_vs_alone", "graph_job_ms_store_load",
        "graph_job_ms_store_load_unheld", "status", "error", "seconds")
print({k: s[k] for k in keys if k in s})
PY
}
mkdir -p "$OUT/full"
OUT=$OUT/full bash benchmarks/device/run.sh > "$OUT/full/log" 2>&1
grep -E "^(gpu_check exit|torch|NVIDIA)" "$OUT/full/log"; summary "$OUT/full/gpu_check.json"
# The disk values of a GPU's 64-token chunks (blocks_per_chunk "auto": 8 MiB of raw KV for an 8B
# model) against one 16-token block's (2 MiB): does this host's disk tier slow down past 2 MiB
# values as the CPU VM's buffered writes do (docs/BENCHMARKS.md)? run.sh installed the kit.
for mib in 2 8; do
    PYTHONPATH=/tmp/site:$PWD timeout 120 ${PYTHON:-python3} -m kvstrata.tools.cli bench disk \
        --chunk-mib "$mib" --json > "$OUT/full/bench_disk_${mib}mib.json" 2> "$OUT/full/bench_disk_${mib}mib.err"
    ${PYTHON:-python3} - "$OUT/full/bench_disk_${mib}mib.json" "$mib" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001 - a summary line, never a traceback
    print("bench disk", sys.argv[2], "MiB: no figures:", e); sys.exit()
print("bench disk", sys.argv[2], "MiB", {k: d.get(k) for k in (
    "store_MBps", "raw_write_MBps", "store_vs_raw", "load_MBps", "load_vs_raw", "compression_ratio")})
PY
done
# Writes behind beside a busy Python thread on a host with cores to spare (the 2-core CPU VM runs
# out of cores first, docs/BENCHMARKS.md "The put process"): framed in threads, in processes and
# put by the writer thread, in processes and put by the put process.
for codec in auto raw; do
    PYTHONPATH=/tmp/site:$PWD timeout 300 ${PYTHON:-python3} -m benchmarks.gil_contention --parts writes \
        --codec "$codec" > "$OUT/full/gil_writes_${codec}.json" 2> "$OUT/full/gil_writes_${codec}.err"
    ${PYTHON:-python3} - "$OUT/full/gil_writes_${codec}.json" "$codec" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))["writes_behind"]
except Exception as e:  # noqa: BLE001 - a summary line, never a traceback
    print("gil writes", sys.argv[2], ": no figures:", e); sys.exit()
for interval, row in d.items():
    if isinstance(row, dict):
        print("gil writes", sys.argv[2], interval, {k: (v["beside_busy_gbps"] if isinstance(v, dict) else v)
                                                   for k, v in row.items()})
PY
done
pairs=("$@"); [ ${#pairs[@]} -gt 0 ] || pairs=("32 4" "64 2" "128 2" "128 8" "256 4" "0 0")
for pair in "${pairs[@]}"; do
    set -- $pair
    d=$OUT/s$(echo "$pair" | tr -c 'a-z0-9.\n' -); mkdir -p "$d"
    OUT=$d bash benchmarks/device/run.sh --skip stream_contract --descriptors-per-call "$1" \
        --pace-depth "$2" "${@:3}" > "$d/log" 2>&1
    summary "$d/gpu_check.json"
done
