#!/usr/bin/env bash
# The one prepared command for the H200 GPU machine (one GPU, Python 3.12 as python3, torch and
# transformers 5.17 preinstalled with pillow, numpy, jinja2, nvidia-ml-py; no Ray, Hydra, datasets,
# decord, av; no network). IT HAS NOT RUN ON A GPU YET (docs/benchmarks.md). From the repository root:
#
#   bash scripts/gpu_run.sh [OUT]          # the GPU run: under 8 minutes, at most 8 files in OUT
#   bash scripts/gpu_run.sh --dry-run [OUT]  # the same flow on CPU with tiny sizes (make gpu-dry-run
#                                            # runs it in a venv holding only what the GPU machine has)
#
# OUT defaults to $OUT, else ./gpu-run-out. The run carries build/gpu-wheels (git-ignored: name it in
# the device run's carry list; `make gpu-wheels` fills it: megatron-core 0.16.1 for Python 3.12 and
# for this machine's python3, about 5 MB) and installs it into a temporary directory put first on
# PYTHONPATH (a transformers wheel too, if the Makefile's TRANSFORMERS_FLOOR is above the installed one).
# `nvidia-smi` memory is logged every second. Then, each step under its own timeout:
#   1. probe     scripts/gpu_probe.py: device, SMs, free memory, green contexts, stream concurrency
#   2. schedules scripts/bench_gpu.py, small model in fp32, all four schedules: token identity across them
#   3. megatron  scripts/gpu_check_megatron.py: Megatron vs HF on a random ~1.5B Qwen2.5-VL, bf16
#   4. bench     scripts/bench_gpu.py, random ~3.4B Qwen2.5-VL in bf16 at a reduced image side and
#                response length, rollplex first (each schedule's line is printed when it finishes)
# Files in OUT: summary.txt (one line per step, then the verdict, also the last line printed),
# setup.log, nvidia_smi.csv, probe.json and one <step>.log per step.
set -uo pipefail

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT="${1:-${OUT:-gpu-run-out}}"
PY="${PYTHON:-python3}"
if [[ "$PY" == */* ]]; then PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"; fi  # the steps run elsewhere
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WHEELS="$ROOT/build/gpu-wheels"
# per-step limits (s): 30 + 40 + 90 + 120 + 170 = 450 s; T_TOTAL caps the whole (a step gets at most
# what is left of it, each killed 5 s after its limit): under 8 minutes on the GPU machine
T_SETUP=30 T_PROBE=40 T_SCHEDULES=90 T_MEGATRON=120 T_BENCH=170 T_TOTAL=450

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-run.XXXXXX")"
SITE="$WORK/site"
SMI_PID=""
cleanup() {
  if [[ -n "$SMI_PID" ]]; then kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
: > "$OUT/summary.txt"
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
START=$SECONDS

# ---- setup: carried wheels into $SITE, first on PYTHONPATH -------------------------------------------
{
  echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0])') ($PY)"
  ls -l "$WHEELS" 2>&1
  if ! timeout "$T_SETUP" "$PY" -m pip install -q --no-index --no-deps --target "$SITE" --find-links "$WHEELS" 'megatron-core==0.16.1'; then
    # no pip for this python3: a wheel is a zip archive of what an install puts in site-packages
    tag="cp$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
    wheel="$(ls "$WHEELS"/megatron_core-0.16.1-"$tag"-*.whl)" && "$PY" -m zipfile -e "$wheel" "$SITE"
  fi
  floor="$(sed -n 's/^TRANSFORMERS_FLOOR := //p' "$ROOT/Makefile")"
  if ! "$PY" - "$floor" <<'EOF'
import sys
from importlib.metadata import version
have = tuple(int(x) for x in version("transformers").split(".")[:2])
need = tuple(int(x) for x in sys.argv[1].split(".")[:2])
print(f"transformers {version('transformers')} installed, floor {sys.argv[1]}")
sys.exit(0 if have >= need else 1)
EOF
  then
    timeout "$T_SETUP" "$PY" -m pip install -q --no-index --no-deps --target "$SITE" --find-links "$WHEELS" "transformers==$floor"
  fi
} > "$OUT/setup.log" 2>&1
SETUP_RC=$?
export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -c 'import megatron.core, rollplex_train, transformers; print("imports ok: transformers", transformers.__version__)' \
  >> "$OUT/setup.log" 2>&1 || SETUP_RC=1
shape="$("$PY" -c 'import importlib.util as u; print(",".join(m for m in ("hydra", "omegaconf", "ray", "datasets", "pyarrow", "decord", "av") if u.find_spec(m)) or "gpu-machine-shaped")')"
say "setup rc=$SETUP_RC seconds=$((SECONDS - START)) interpreter=$shape"
if [[ $SETUP_RC -ne 0 ]]; then
  say "gpu-run: FAIL setup (see setup.log; the carry list must name build/gpu-wheels: make gpu-wheels)"
  exit 1
fi

# ---- nvidia-smi memory, every second ----------------------------------------------------------------
if [[ $DRY -eq 0 ]] && command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu,power.draw --format=csv,nounits -l 1 \
    > "$OUT/nvidia_smi.csv" 2>&1 &
  SMI_PID=$!
else
  echo "no nvidia-smi logging (dry run or no nvidia-smi on PATH)" > "$OUT/nvidia_smi.csv"
fi

# ---- the steps --------------------------------------------------------------------------------------
FAILED=()
STEPS=0
# step NAME LIMIT_S EXPECT -- command...: runs under `timeout`, output to NAME.log; failed when it exits
# non-zero or its output lacks the EXPECT line (a grep -E pattern)
step() {
  local name="$1" limit="$2" expect="$3" begin=$SECONDS rc left
  shift 4
  STEPS=$((STEPS + 1))
  left=$((T_TOTAL - (SECONDS - START)))
  if [[ $left -lt $limit ]]; then limit=$left; fi
  if [[ $limit -lt 5 ]]; then
    echo "not run: T_TOTAL=${T_TOTAL}s spent" > "$OUT/$name.log"; rc=124
  else
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
  fi
  if [[ $rc -eq 0 ]] && ! grep -Eq "$expect" "$OUT/$name.log"; then rc=99; fi
  [[ $rc -ne 0 ]] && FAILED+=("$name")
  say "step $name rc=$rc seconds=$((SECONDS - begin)) last: $(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1)"
}

cd "$WORK" || exit 1
if [[ $DRY -eq 1 ]]; then
  step probe "$T_PROBE" '^gpu-probe: device=cpu' -- "$PY" "$ROOT/scripts/gpu_probe.py" --device cpu --out "$OUT/probe.json"
  step schedules "$T_SCHEDULES" 'identical across schedules=yes' -- \
    "$PY" "$ROOT/scripts/bench_gpu.py" --dry-run --out "$WORK/schedules"
  step megatron "$T_MEGATRON" 'hf_roundtrip=exact' -- \
    "$PY" "$ROOT/scripts/gpu_check_megatron.py" --smoke --steps 1 --out "$WORK/megatron"
  step bench "$T_BENCH" '^schedules: ' -- \
    "$PY" "$ROOT/scripts/bench_gpu.py" --dry-run --only rollplex,serial,serial_shared,disaggregated --out "$WORK/bench"
else
  step probe "$T_PROBE" '^gpu-probe: ' -- "$PY" "$ROOT/scripts/gpu_probe.py" --out "$OUT/probe.json"
  step schedules "$T_SCHEDULES" 'identical across schedules=yes' -- \
    "$PY" "$ROOT/scripts/bench_gpu.py" --size small --compute-dtype float32 --prompts 4 --n 4 --response-len 64 \
    --frames 4 --side 224 --micro-batch 4 --steps 4 --out "$WORK/schedules"
  step megatron "$T_MEGATRON" 'hf_roundtrip=exact' -- \
    "$PY" "$ROOT/scripts/gpu_check_megatron.py" --steps 2 --out "$WORK/megatron"
  step bench "$T_BENCH" '^rollplex ' -- \
    "$PY" "$ROOT/scripts/bench_gpu.py" --size 3b --compute-dtype bfloat16 --prompts 4 --n 8 --response-len 128 \
    --frames 8 --side 224 --micro-batch 8 --steps 4 --only rollplex,serial,serial_shared,disaggregated --out "$WORK/bench"
fi

mode=$([[ $DRY -eq 1 ]] && echo "dry-run " || echo "")
say "total seconds=$((SECONDS - START))"
if [[ ${#FAILED[@]} -eq 0 ]]; then
  say "gpu-run: ${mode}ok steps=$STEPS"
  exit 0
fi
say "gpu-run: ${mode}FAIL ${FAILED[*]} steps=$STEPS"
exit 1
