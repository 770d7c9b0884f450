#!/usr/bin/env bash
# The device check, on a machine with one CUDA GPU: build fastpipe's
# extensions there (with the CUDA backend and fastpipe._chain), run the native
# ring's tests, then every CUDA figure and check in bench/gpu_check.py (ring,
# Pipes rebuilt over one model, packing, a 200-step soak, no host sync inside a
# step, the GPT's step times and memory on 2 local ranks on cuda:0, gradients
# of every schedule on the GPU and of a model built on the meta device, Triton
# kernels, a 2-rank local MLP pipeline, selective recompute).
#
#   bash bench/gpu_check.sh            # PYTHON=python3 by default
#   SECTIONS="ring local" bash bench/gpu_check.sh
#   BUDGET=600 bash bench/gpu_check.sh # seconds for the whole check (290)
#
# Each section runs in a process of its own under a time limit, so a section
# that hangs or crashes costs only itself: on its deadline it prints every
# thread's stack and ends, and the next section starts. The whole check ends
# within BUDGET seconds of its start: a section's limit is cut to what is
# left, a section with under 20 s left is skipped (the status is then
# non-zero), and the default order runs first what no CPU can show (streams
# across rebuilt Pipes, packing at copy bandwidth, the soak), then the GPT.
# With OUT set, the build log, the whole output and each section's figures
# (JSON) go there. The exit status is non-zero when the build, the ring tests
# or any check failed, or a section was skipped.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
SECTIONS=${SECTIONS:-"ring rebuild pack soak syncs gpt grads kernels local recompute"}
BUDGET=${BUDGET:-290}
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee "$OUT/gpu_check.log") 2>&1  # the whole output, beside each section's JSON
fi
LOG=${OUT:-/tmp}/gpu_check_build.log
status=0
skipped=""
t_start=$(date +%s)

echo "== build"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null
"$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
# In place: no packaging metadata, no dependency resolution (nothing can be fetched).
# The CUDA backend is required; if its headers are not found, build without it
# so the other sections still run (the ring section then fails, as it should).
# fastpipe._chain (built against the device's torch) carries the native
# deferring forward, I and W that users get on every device: built too, and
# should it fail to build there, the rest is built without it (the Python
# path then runs, and the output says so).
export FASTPIPE_BUILD_JOBS=${FASTPIPE_BUILD_JOBS:-12}
export FASTPIPE_NATIVE_CHAIN=${FASTPIPE_NATIVE_CHAIN:-1}
if [ -z "${CUDA_HOME:-}" ] && [ ! -f /usr/local/cuda/include/cuda_runtime_api.h ]; then
    # No toolkit at the usual place: the headers of a pip-installed CUDA runtime do.
    header=$("$PY" -c "import site; print('\n'.join(site.getsitepackages()))" \
             | xargs -I{} find {}/nvidia -name cuda_runtime_api.h 2>/dev/null | head -1)
    [ -n "$header" ] && export CUDA_HOME=$(dirname "$(dirname "$header")") && echo "CUDA_HOME=$CUDA_HOME"
fi
# What was asked first, then without _chain, then without CUDA, then
# neither; anything asked for and not built makes the status non-zero.
wanted="1 $FASTPIPE_NATIVE_CHAIN"
built=""
tried=""
for combo in "$wanted" "1 0" "0 $FASTPIPE_NATIVE_CHAIN" "0 0"; do
    read -r cuda chain <<<"$combo"
    case "$tried" in *"[$cuda$chain]"*) continue ;; esac
    tried="$tried[$cuda$chain]"
    rm -f fastpipe/_C*.so fastpipe/_chain*.so  # nothing left from an earlier build
    if FASTPIPE_CUDA=$cuda FASTPIPE_NATIVE_CHAIN=$chain "$PY" setup.py -q build_ext --inplace \
        >"$LOG" 2>&1; then
        built=$combo
        break
    fi
    echo "build with FASTPIPE_CUDA=$cuda FASTPIPE_NATIVE_CHAIN=$chain failed:"
    tail -15 "$LOG"
done
if [ -z "$built" ]; then
    echo "build failed"
    exit 1
fi
if [ "$built" != "$wanted" ]; then
    echo "built with FASTPIPE_CUDA, FASTPIPE_NATIVE_CHAIN = $built, not $wanted as asked"
    status=1
fi
"$PY" -c "import torch, fastpipe._C as C; print('has_cuda', C.has_cuda, '|', C.cuda_status())"
"$PY" -c "from fastpipe.runtime.deferred import native_chain; print('native deferral (fastpipe._chain):', native_chain() is not None)"
# The toolchain that built it (csrc/checks.h says why it can matter).
"$PY" -c "import sysconfig; print('LDSHARED', sysconfig.get_config_var('LDSHARED'))"
echo "CXX=${CXX:-} LDFLAGS=${LDFLAGS:-}"
echo "  (build done at $(( $(date +%s) - t_start )) s)"

echo "== ring tests (host lanes, buffer ring, CUDA streams and events)"
left() { echo $(( BUDGET - ($(date +%s) - t_start) )); }
ring_limit=$(( $(left) < 90 ? $(left) : 90 ))
[ "$ring_limit" -lt 10 ] && ring_limit=10
timeout -k 5 "$ring_limit" "$PY" -m pytest -q -x -p no:cacheprovider tests/test_host_ring.py tests/test_buffer_ring.py \
    || status=1
echo "  (ring tests done at $(( $(date +%s) - t_start )) s)"

# Seconds each section may take before it dumps its stacks and ends.
declare -A LIMIT=([ring]=30 [gpt]=160 [local]=140 [grads]=45 [pack]=45 [kernels]=60 [recompute]=30
              [rebuild]=60 [soak]=90 [syncs]=30)
for section in $SECTIONS; do
    limit=${LIMIT[$section]:-60}
    room=$(( $(left) - 15 ))  # the kill's grace and the next line's print
    if [ "$room" -lt 20 ]; then
        echo "== $section skipped: $(left) s left of BUDGET=$BUDGET"
        skipped="$skipped $section"
        status=1
        continue
    fi
    [ "$room" -lt "$limit" ] && limit=$room
    timeout -k 5 $((limit + 10)) "$PY" -m bench.gpu_check --sections "$section" --deadline "$limit" \
        ${OUT:+--out "$OUT/gpu_check_$section.json"} || status=1
    echo "  ($section done at $(( $(date +%s) - t_start )) s)"
done
echo "gpu_check: $(( $(date +%s) - t_start )) s in all; skipped for the budget:${skipped:- none}"
exit $status
