#!/usr/bin/env bash
# One session on a machine with a CUDA GPU (16 CPU cores): what only a GPU can check, then the charged
# n-body set at 2x the CPU budget. From the repository root, with EGNN's checkout at peers/egnn:
#
#     OUT=/tmp/out bash benchmarks/device/nbody_long.sh
#
# 1. the CUDA tests (tests/test_cuda.py, at most 150 s) while `geoattn data make nbody-charged` writes
#    the files on one core;
# 2. `geoattn experiment nbody-clifford-17k --jobs 6`, six runs at once with nothing else beside them,
#    stopped at the deadline (unfinished runs keep their checkpoints);
# 3. `geoattn bench attention` on the GPU with what time is left.
# $OUT receives five files (the device tool returns eight at most): the test, data, experiment and bench
# logs and runs.tgz (the run directories and the report).
#
# Seen on an H200 (2026-12-04, torch 2.11, an earlier order: bench, then tests and the experiment at
# once): the flex and rotor CUDA tests passed; the bench printed no table within its 100 s (it built the
# native CPU kernel, then compiles one FlexAttention graph per path and length); six runs went at 30-40
# ms a step (the Clifford model's and EGNN's alike) beside the tests' compilers, so 17,040 steps did not
# finish in the 328 s left.
set -u
OUT=${OUT:-/tmp/nbody-long}
DEADLINE=$((SECONDS + ${BUDGET_S:-560}))
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 GEOATTN_PEERS=$PWD/peers GEOATTN_CORPUS=$PWD/README.md
py=${PYTHON:-python3}
log() { echo "[$SECONDS s] $*"; }

log "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
$py -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name())"
$py -m geoattn data make nbody-charged --out data/nbody-charged > "$OUT/data.log" 2>&1 &
data=$!
timeout 150 $py -m pytest -q -p no:cacheprovider -p no:logging tests/test_cuda.py > "$OUT/test_cuda.txt" 2>&1
log "tests: exit $? ($(tail -1 "$OUT/test_cuda.txt"))"
wait $data; log "data: exit $? ($(tail -1 "$OUT/data.log"))"

left=$((DEADLINE - SECONDS - 60))
name=nbody-clifford-17k
log "running $name with $left s left"
timeout -k 15 $left $py -m geoattn experiment $name --jobs 6 > "$OUT/experiment.txt" 2>&1
log "experiment: exit $?"
tar czf "$OUT/runs.tgz" runs/experiments results/$name* 2>/dev/null
left=$((DEADLINE - SECONDS))
[ $left -gt 20 ] && timeout $left $py -m geoattn bench attention --device cuda --sizes 1024 8192 --repeats 5 \
    > "$OUT/bench_attention.txt" 2>&1
log "done; $(du -h "$OUT/runs.tgz" | cut -f1) of runs"
