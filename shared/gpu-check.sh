#!/usr/bin/env bash
# One call on a GPU machine where the packages are on PYTHONPATH but not installed (the H200 of the device
# tool, through .gpu/run.sh): the gpu tier of every package and of tests-integration, then the benchmarks,
# folded file by file into one pytest-benchmark JSON per package (<package>.json).
#
#   bash .gpu/run.sh bash shared/gpu-check.sh                 # results under $OUT (or shared/benchmarks/<gpu>)
#   PACKAGES="tk-quant" BENCH_FILTER="not torch" bash .gpu/run.sh bash shared/gpu-check.sh
#   SKIP_BENCH=1 ... / SKIP_TIER=1 ...     # the tier alone / the benchmarks alone (two device calls of < 10 min)
#   BENCH_FILES="packages/tk-quant/benchmarks/bench_swiglu.py ..." ...   # these bench files, in this order
#   REQUIRE_GPU=H200 ...   # run nothing (exit 3) unless the GPU's name contains H200: a call that may get an H100 for
#                          # an H200 request then spends only the machine's start, not a tier whose figures exist
set -uo pipefail
packages=${PACKAGES:-"tk-core tk-transpose tk-quant tk-engram"}
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [ -n "${REQUIRE_GPU:-}" ] && [[ "$gpu_name" != *"$REQUIRE_GPU"* ]]; then
  echo "gpu-check: REQUIRE_GPU=$REQUIRE_GPU but this GPU is '$gpu_name'; nothing run"
  exit 3
fi
gpu=$(printf '%s\n' "$gpu_name" | grep -oE '[A-Z]+[0-9]+' | head -1 | tr A-Z a-z)
out=${OUT:-shared/benchmarks/${gpu:-gpu}}
mkdir -p "$out"
paths=$(for p in $packages; do printf 'packages/%s ' "$p"; done)
if [ "${SKIP_TIER:-0}" != 1 ]; then
  python3 -m pytest $paths tests-integration -m gpu -n "${WORKERS:-16}" -q -p no:cacheprovider >"$out/gpu.log" 2>&1
  echo "gpu tier: $(tail -1 "$out/gpu.log")"
  grep -E '^(FAILED|ERROR)' "$out/gpu.log" | cut -c1-200 | head -30
fi
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
# One pytest call per benchmark file: pytest-benchmark writes its JSON only when the session ends, so a call cut
# short by a time limit would lose every figure of the package. Each file's JSON goes to a scratch folder and is
# folded at once into <out>/<package>.json (shared/benchmarks/merge.py): the device tool returns only a few files.
runs=$(mktemp -d)
for f in ${BENCH_FILES:-$(for p in $packages; do ls packages/$p/benchmarks/bench_*.py 2>/dev/null; done)}; do
  name=$(basename "$(dirname "$(dirname "$f")")")-$(basename "$f" .py)
  python3 -m pytest "$f" -m benchmark --run-benchmark -q -p no:cacheprovider -k "${BENCH_FILTER:-}" \
    --benchmark-json "$runs/$name.json" >>"$out/bench.log" 2>&1
  echo "$name: $(tail -1 "$out/bench.log")"
  [ -f "$runs/$name.json" ] || continue
  python3 shared/benchmarks/merge.py "$runs" "$out" "gpu-check.sh run" >/dev/null
  python3 - "$runs/$name.json" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    e = b["extra_info"]
    shape = ",".join(f"{k}={v}" for k, v in sorted(e.items()) if k not in (
        "kernel", "impl", "bytes", "device_us", "eager_us", "gbps", "copy_gbps", "pct_of_copy", "timer"))
    print(f"  {e['kernel']:<48} {e['impl']:<13} {e['device_us']:>9.1f} us {e['gbps']:>6.0f} GB/s "
          f"{e['pct_of_copy']:>5.1f}%  {shape}")
PY
done
