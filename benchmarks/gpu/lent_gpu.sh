#!/usr/bin/env bash
# The GPU check in one call on a lent GPU machine, which returns at most 8 files from $OUT and keeps nothing.
#
# Installs the wheels carried in .whl (TRL and datasets for the step profile's TRL row: see docs/benchmarks.md, "GPU
# check"), runs `make gpu-check` (every part within its 8-minute budget; arguments go to check.py, e.g. --only
# planner), and leaves in $OUT: report.md, report.json and parts-and-logs.tgz (each part's JSON and log). Exits with
# the check's status.
#
#   make gpu-wheels                                     # before the call, where a registry is reached
#   bash benchmarks/gpu/lent_gpu.sh                     # carry .whl with the call
#   bash benchmarks/gpu/lent_gpu.sh --only "max length"
set -uo pipefail
out=${OUT:?"set OUT to the folder whose files come back"}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" .whl/*.whl \
        && export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "lent_gpu.sh: no wheels in .whl (run 'make gpu-wheels' before the call and carry .whl): the step profile's TRL row will say what is missing" >&2
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
args=""  # printf of no arguments would give one empty argument, which check.py refuses
[ $# -eq 0 ] || args=$(printf '%q ' "$@")
make gpu-check OUT="$work/gpu-check" GPU_CHECK_ARGS="$args"
status=$?
cp "$work/gpu-check/report.md" "$work/gpu-check/report.json" "$out"/ 2>/dev/null
tar -czf "$out/parts-and-logs.tgz" -C "$work/gpu-check" parts logs 2>/dev/null
exit $status
