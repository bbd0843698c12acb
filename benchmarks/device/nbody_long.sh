#!/usr/bin/env bash
# One session on a machine with a CUDA GPU (16 CPU cores): what only a GPU can check, then the longest
# n-body budget that fits. From the repository root, with EGNN's checkout at peers/egnn:
#
#     OUT=/tmp/out bash benchmarks/device/nbody_long.sh
#
# 1. `geoattn bench attention` on the GPU, while `geoattn data make nbody-charged` writes the files;
# 2. the CUDA tests (tests/test_cuda.py), beside a probe of the Clifford model's compiled step with
#    six processes sharing the GPU (the experiment's load): its ms per step picks the budget;
# 3. `geoattn experiment nbody-clifford-34k` if 34,080 steps fit the time left, else
#    `nbody-clifford-17k`, six runs at once; stopped at the deadline (unfinished runs keep their
#    checkpoints). $OUT receives six files (the device tool returns eight at most): the bench, data and
#    test logs, the probes' lines, the experiment's log and runs.tgz (run directories and the report).
#
# Seen on an H200 (2026-12-04, torch 2.11): the flex and rotor CUDA tests passed; the bench printed no
# table within its 100 s (it built the native CPU kernel first, then compiles one FlexAttention graph per
# path and length); six processes ran at 30-40 ms a step (the Clifford model's and EGNN's alike, the CPU
# cores shared with the compilers of the tests), so 17,040 steps did not finish in the 328 s left.
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

timeout 100 $py -m geoattn bench attention --device cuda --sizes 1024 8192 --repeats 5 \
    > "$OUT/bench_attention.txt" 2>&1
log "bench attention: exit $?"

timeout 240 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py > "$OUT/test_cuda.txt" 2>&1 &
tests=$!
probes=()
for i in $(seq "${PROBES:-6}"); do
    OMP_NUM_THREADS=2 timeout 200 $py benchmarks/device/clifford_probe.py > "/tmp/probe_$i.txt" 2>&1 &
    probes+=($!)
done
wait "${probes[@]}"
wait $data; log "data: exit $? ($(tail -1 "$OUT/data.log"))"
grep -h "_s \|ms_per_step" /tmp/probe_*.txt > "$OUT/probes.txt"
ms=$(sed -n 's/^ms_per_step //p' "$OUT/probes.txt" | sort -g | tail -1)
log "probe: ms per step of the slowest of six: ${ms:-none}"
left=$((DEADLINE - SECONDS))
name=nbody-clifford-17k
if [ -n "$ms" ] && $py -c "import sys; sys.exit(not ($ms * 34080 * 1.3 / 1000 + 60 < $left))"; then
    name=nbody-clifford-34k
fi
log "running $name with $left s left"
timeout -k 15 $((DEADLINE - SECONDS)) $py -m geoattn experiment $name --jobs 6 > "$OUT/experiment.txt" 2>&1
log "experiment: exit $?"
wait $tests; log "tests: exit $? ($(tail -1 "$OUT/test_cuda.txt"))"
tar czf "$OUT/runs.tgz" runs/experiments results/$name* 2>/dev/null
log "done; $(du -h "$OUT/runs.tgz" | cut -f1) of runs"
