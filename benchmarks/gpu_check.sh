#!/usr/bin/env bash
# The GPU node's check, in one command (about 4 minutes): what docs/performance.md's "GPU notes" report, again.
#
#     bash benchmarks/gpu_check.sh            # on a node with an NVIDIA GPU, from the repo's root or not
#
# 1. nvidia-smi and torch.cuda (a CUDA build of torch is the user's to install, see below);
# 2. `import torch` and `import ray.train.torch` in fresh processes (every Train worker pays them);
# 3. benchmarks/fsdp_speed.py on the GPU(s): NCCL, bf16, FSDP's variants against DDP at 2 GPUs, or
#    one worker's fsdp (unwrapped) against DDP on one GPU;
# 4. benchmarks/overhead.py --workers 1: submission to step 1 and the steady state, Apiary against
#    plain DDP (its jobs ask for CPUs: it has no GPU option);
# 5. a one-worker DDP and FSDP job, bf16, `resources_per_worker: {GPU: 1}`, through `apiary serve`
#    (benchmarks/gpu_jobs.py starts one, with its own local Ray, which finds the GPUs);
# then one summary. Every step's full output stays in the log folder it names.
#
# The venv: .venv is made (pip install -e '.[dev]') if it is missing. pyproject pins torch==2.13.0;
# where pip resolves a CPU-only build of it, install the CUDA one into the venv, e.g.:
#     .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# (cu128 for a recent driver; pick the index of the CUDA version nvidia-smi allows).
# Without a GPU the check stops at once, exit status 1, with a one-line message.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
fail() {
    echo "gpu_check: $*" >&2
    exit 1
}

command -v nvidia-smi >/dev/null 2>&1 || fail "no GPU here: nvidia-smi not found (run this on a node with an NVIDIA GPU)"
gpus=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null) ||
    fail "no GPU here: nvidia-smi failed (no driver or no device)"
[ -n "$gpus" ] || fail "no GPU here: nvidia-smi lists no device"
num_gpus=$(printf '%s\n' "$gpus" | wc -l)

if [ ! -x .venv/bin/python ]; then
    echo "gpu_check: making .venv (pip install -e '.[dev]', a few minutes) ..."
    python3 -m venv .venv
    .venv/bin/pip install -q -e '.[dev]'
fi
py=.venv/bin/python
cuda=$("$py" -c 'import torch; print(torch.version.cuda or "none", torch.cuda.is_available())') ||
    fail "torch does not import in .venv"
case "$cuda" in
*True) ;;
*) fail "torch $("$py" -c 'import torch; print(torch.__version__)') in .venv has no CUDA (torch.version.cuda, is_available: $cuda); install a CUDA build: .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" ;;
esac

logs=$(mktemp -d "${TMPDIR:-/tmp}/apiary-gpu-check.XXXXXX")
started=$SECONDS
echo "gpu_check: $num_gpus GPU(s), torch CUDA $cuda; logs in $logs"

# Each step: its own log and time limit; a failed step is reported, and the others still run.
status=0
step() {
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS
    echo "gpu_check: $name ..."
    if timeout "$limit" "$@" >"$logs/$name.log" 2>&1; then
        echo "$name: ok in $((SECONDS - began)) s" >>"$logs/steps"
    else
        echo "$name: FAILED (exit $?, after $((SECONDS - began)) s; see $logs/$name.log)" >>"$logs/steps"
        status=1
    fi
}

step imports 60 "$py" -c "
import subprocess, sys
for module in ('torch', 'ray.train.torch'):  # each in a fresh process, as a Train worker starts
    code = f'import time; t = time.perf_counter(); import {module}; print(f\"import {module}: {{time.perf_counter() - t:.1f}} s\")'
    subprocess.run([sys.executable, '-c', code], check=True)
"

world_size=1
extra=()
if [ "$num_gpus" -ge 2 ]; then
    world_size=2
    extra=(--one-worker)
fi
step fsdp_speed 120 "$py" benchmarks/fsdp_speed.py --device cuda --world-size "$world_size" \
    --precision bf16 --sizes small,large --rounds 1 --steps 20 --batch-size 32 "${extra[@]}"

step overhead 150 "$py" benchmarks/overhead.py --workers 1 --steps 60 --repeats 1

step jobs 300 "$py" benchmarks/gpu_jobs.py --steps 200 --timeout-s 120

echo
echo "== GPU check: $(hostname), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $((SECONDS - started)) s =="
printf '%s\n' "$gpus" | sed 's/^/GPU: /'
echo "torch: $("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
cat "$logs/steps"
grep -h "import " "$logs/imports.log" || true
grep -hE "ranks|x DDP|one worker" "$logs/fsdp_speed.log" || true
grep -hE "fixed cost|steady state|start to end of step 1" "$logs/overhead.log" || true
grep -hE "jobs over REST|samples/s|fsdp / ddp" "$logs/jobs.log" || true
echo "logs: $logs"
exit "$status"
