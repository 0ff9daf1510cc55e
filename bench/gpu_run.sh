#!/usr/bin/env bash
# The device bench in one call, on a machine with its own python3 and torch and no venv, to
# which only the working tree is copied (see bench/README.md, "GPU benchmark").
#
#   bash bench/gpu_run.sh              # GPU: python -m bench.gpu --require-gpu, <= 8 min
#   bash bench/gpu_run.sh --cpu-smoke  # anywhere: deps + imports + the bit-exact round trip on CPU
#   bash bench/gpu_run.sh --dry-run    # checks and installs, then prints the bench command
#
# Extra arguments after these go to python -m bench.gpu. Writes bench/results/gpu-latest.json,
# and a copy (plus the log) under $OUT when OUT is set. GPU_BENCH_BUDGET_S: the bench's time
# limit in seconds (default 450). The machine's own torch is never touched: the carried wheels
# (bench/wheels) of what it lacks go into a temporary --target directory on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=gpu
case "${1:-}" in
  --cpu-smoke) mode=smoke; shift ;;
  --dry-run) mode=dry; shift ;;
esac
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "Strata: no $PY on PATH; set PYTHON=/path/to/python3" >&2; exit 2; }
"$PY" -c 'import torch' 2>/dev/null || {
  echo "Strata: $PY ($(command -v "$PY")) has no torch; run this where python3 imports torch, or set PYTHON" >&2
  exit 2
}
site=$(mktemp -d "${TMPDIR:-/tmp}/strata-gpu-site.XXXXXX")
trap 'rm -rf "$site"' EXIT
mapfile -t wheels < <("$PY" -m bench.gpu_deps --wheels bench/wheels)
if ((${#wheels[@]})); then
  echo "installing into $site: ${wheels[*]##*/}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}"
fi
export PYTHONPATH="$PWD/sidecar:$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" -c 'import strata.client, bench.gpu, google_crc32c, torch; print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
case $mode in
  dry) echo "would run: $PY -m bench.gpu --require-gpu $*"; exit 0 ;;
  smoke) rc=0; "$PY" -m bench.gpu --cpu-smoke "$@" || rc=$?; exit "$rc" ;;  # not exec: the trap cleans up
esac
log=bench/results/gpu-latest.log
mkdir -p bench/results
start=$(mktemp "${TMPDIR:-/tmp}/strata-gpu-start.XXXXXX")
trap 'rm -rf "$site" "$start"' EXIT
rc=0
timeout --signal=INT --kill-after=20 "${GPU_BENCH_BUDGET_S:-450}" \
  "$PY" -m bench.gpu --require-gpu "$@" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
if [[ -n "${OUT:-}" ]]; then
  cp -f "$log" "$OUT/" || true
  [[ bench/results/gpu-latest.json -nt "$start" ]] && cp -f bench/results/gpu-latest.json "$OUT/"
fi
exit "$rc"
