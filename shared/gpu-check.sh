#!/usr/bin/env bash
# One call on a GPU machine where the packages are on PYTHONPATH but not installed (the H200 of the device
# tool, through .gpu/run.sh): the gpu tier of every package and of tests-integration, then the benchmarks,
# one pytest-benchmark JSON per package.
#
#   bash .gpu/run.sh bash shared/gpu-check.sh                 # results under $OUT (or shared/benchmarks/<gpu>)
#   PACKAGES="tk-quant" BENCH_FILTER="not torch" bash .gpu/run.sh bash shared/gpu-check.sh
set -uo pipefail
packages=${PACKAGES:-"tk-core tk-transpose tk-quant tk-engram"}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE '[A-Z]+[0-9]+' | head -1 | tr A-Z a-z)
out=${OUT:-shared/benchmarks/${gpu:-gpu}}
mkdir -p "$out"
paths=$(for p in $packages; do printf 'packages/%s ' "$p"; done)
python3 -m pytest $paths tests-integration -m gpu -n "${WORKERS:-16}" -q -p no:cacheprovider >"$out/gpu.log" 2>&1
echo "gpu tier: $(tail -1 "$out/gpu.log")"
grep -E '^(FAILED|ERROR)' "$out/gpu.log" | cut -c1-200 | head -30
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
for p in $packages; do
  [ "$p" = tk-core ] && continue
  python3 -m pytest "packages/$p" -m benchmark --run-benchmark -q -p no:cacheprovider -k "${BENCH_FILTER:-}" \
    --benchmark-json "$out/$p.json" >"$out/bench-$p.log" 2>&1
  echo "bench $p: $(tail -1 "$out/bench-$p.log")"
  python3 - "$out/$p.json" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    e = b["extra_info"]
    shape = ",".join(f"{k}={v}" for k, v in sorted(e.items()) if k not in (
        "kernel", "impl", "bytes", "device_us", "eager_us", "gbps", "copy_gbps", "pct_of_copy"))
    print(f"  {e['kernel']:<48} {e['impl']:<13} {e['device_us']:>9.1f} us {e['gbps']:>6.0f} GB/s "
          f"{e['pct_of_copy']:>5.1f}%  {shape}")
PY
done
