#!/usr/bin/env bash
# The loader's GPU checks in one short run (about 5-6 minutes) on a CUDA machine:
#
#     bash benchmarks/device_check.sh [OUTDIR]
#
# 1. tests on CUDA: tests/loader/test_gpu.py (pinned pool, side-stream prefetch,
#    record_stream, resume, kvikio GDS reads; skipped elsewhere), plus the GDS,
#    segmented-copy, diagnose and loader tests (the loader tests on a GPU host too);
# 2. benchmarks/gpu_check.py: pinned vs pageable H2D, prefetch overlap, the GDS path;
# 3. benchmarks/loader_bench.py with the loader delivering to the GPU (--device cuda)
#    and to host memory (--device cpu), on this host's cores;
# 4. nccl: tests/loader/test_loader_distributed.py: the cross-node all-reduce of the
#    epoch's batch counts through NCCL on the current CUDA device (NCCL takes one GPU per
#    rank, so on one GPU a group of one rank that the dataset is told spans nodes; and
#    a "cpu:gloo,cuda:nccl" group, which reduces on the CPU; a CPU tensor under NCCL is
#    refused), plus the 2 nodes x 2 ranks gloo run and the device-choice tests.
#
# It runs with the python3 on PATH and that interpreter's packages (a GPU image's
# torch, pyarrow, numpy, numba), without installing the project: a shim folder maps
# userwise.pipelines -> pipelines/ and userwise.schemas -> schemas/ (as the
# project's package-dir does). Wheels in .whl/ (e.g. kvikio-cu13, libkvikio-cu13,
# rapids-logger for the GDS path) are installed into a scratch folder first.
# Every step has its own time limit; a failing step does not stop the others.
# STEPS="env tests" (default: all but loader_bench_cuda_copy, the same benchmark with
# the workers' batches copied into pinned buffers, i.e. zero_copy=False) picks steps; BENCH_PROFILES="long" (default
# "long short") the loader benchmark's sample-size profiles.
# Output: OUTDIR/device_check.log and the benchmarks' JSON files.
set -u
OUTDIR=${1:-${OUT:-/tmp/device_check}}
mkdir -p "$OUTDIR"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
LOG=$OUTDIR/device_check.log
: >"$LOG"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/uw-site .whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
    export PYTHONPATH=/tmp/uw-site${PYTHONPATH:+:$PYTHONPATH}
fi
SHIM=$(mktemp -d)
mkdir -p "$SHIM/userwise"
ln -s "$REPO/pipelines" "$SHIM/userwise/pipelines"
ln -s "$REPO/schemas" "$SHIM/userwise/schemas"
export PYTHONPATH=$SHIM:$REPO${PYTHONPATH:+:$PYTHONPATH}

STEPS=${STEPS:-env tests gpu_check loader_bench_cuda loader_bench_cpu nccl}
step() {  # step NAME LIMIT_S CMD...
    local name=$1 lim=$2 t0
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    t0=$(date +%s)
    echo "== $name (limit ${lim}s)" | tee -a "$LOG"
    timeout "$lim" "$@" 2>&1 | grep -v -E "^\s*$" | tee -a "$LOG"
    echo "== $name: rc=${PIPESTATUS[0]} in $(($(date +%s) - t0))s" | tee -a "$LOG"
}

step env 60 bash -c 'nvidia-smi -L; nproc; free -g | head -2; python3 -c "
import sys, numpy, pyarrow, torch
print(sys.version.split()[0], \"numpy\", numpy.__version__, \"pyarrow\", pyarrow.__version__, \"torch\", torch.__version__,
      \"cuda\", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"\")
for m in (\"numba\", \"kvikio\", \"psutil\"):
    try:
        print(m, __import__(m).__version__)
    except Exception as e:
        print(m, \"unavailable:\", type(e).__name__, e)
import userwise.pipelines.loader as L; print(\"loader from\", L.__file__)
"'
step tests 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
    tests/loader/test_gpu.py tests/shards/test_gds.py tests/loader/test_segcopy.py tests/benchmarks/test_loader_tools.py \
    tests/loader/test_loader.py
step gpu_check 110 python3 benchmarks/gpu_check.py --cap-s 15 --out "$OUTDIR"
step loader_bench_cuda 130 python3 benchmarks/loader_bench.py --device cuda --profiles ${BENCH_PROFILES:-long short} --repeats 5 \
    --workers 0 1 2 --pointwise-cap-s 3 --json "$OUTDIR/loader_bench_cuda.json"
step loader_bench_cuda_copy 130 python3 benchmarks/loader_bench.py --device cuda --profiles ${BENCH_PROFILES:-long short} \
    --repeats 5 --workers 1 2 --pointwise-cap-s 3 --zero-copy off --json "$OUTDIR/loader_bench_cuda_copy.json"
step loader_bench_cpu 130 python3 benchmarks/loader_bench.py --device cpu --profiles ${BENCH_PROFILES:-long short} --repeats 5 \
    --workers 0 1 2 --pointwise-cap-s 3 --json "$OUTDIR/loader_bench_cpu.json"

# -- the trainer (#39), about 2 minutes --------------------------------------------------
# 4. tests/train on CUDA: device spans equal the host's, compiled FlexAttention forward and
#    backward against the pure-torch block attention, the model and stochastic length on the
#    device against the host (the CUDA tests; they skip elsewhere);
# 5. benchmarks/train_bench.py on the GPU: user-wise against point-wise training and the least
#    plan, L = 200 and 1000, the demo, heavy-user and one-request shapes (2 s a figure).
# TRAIN_STEPS (default "train_tests guide train_bench_cuda") picks these; TRAIN_STEPS="" skips them,
# STEPS=none runs them alone.
TRAIN_STEPS=${TRAIN_STEPS-train_tests guide train_bench_cuda}
train_step() {  # train_step NAME LIMIT_S CMD...
    case " $TRAIN_STEPS " in *" $1 "*) STEPS="$1" step "$@" ;; *) return 0 ;; esac
}
train_step train_tests 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs -k cuda \
    tests/train/test_spans_masks.py tests/train/test_model.py
# 4b. the guide: the README's Train block (batches on cuda, the model on their device, all of the
#     node's impressions in one process) and docs/training.md's DDP loop with NCCL (train, checkpoint,
#     resume) on this GPU
train_step guide 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/train/test_guide_loops.py
train_step train_bench_cuda 150 python3 benchmarks/train_bench.py --device cuda --threads 0 --seconds 2 \
    --json "$OUTDIR/train_bench_cuda.json" --plot "$OUTDIR/train_bench_cuda.png"

# -- serving (#48), about 3 minutes ------------------------------------------------------
# 6. tests/serve on CUDA: the K/V store's device tier and the replay's model on the GPU (both
#    default to CUDA where there is one): incremental scoring equal to the full recompute and
#    to the training forward, users moving between device, host (page-locked here) and disk;
# 7. benchmarks/serve_bench.py on the GPU: one request scored from the cache against a full
#    recompute, 1,000 and 4,096 history events, 1, 64 and 256 candidates.
# SERVE_STEPS (default "serve_tests serve_bench_cuda") picks these; SERVE_STEPS="" skips them.
SERVE_STEPS=${SERVE_STEPS-serve_tests serve_bench_cuda}
serve_step() {  # serve_step NAME LIMIT_S CMD...
    case " $SERVE_STEPS " in *" $1 "*) STEPS="$1" step "$@" ;; *) return 0 ;; esac
}
serve_step serve_tests 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/serve
serve_step serve_bench_cuda 120 python3 benchmarks/serve_bench.py --device cuda --threads 0 \
    --json "$OUTDIR/serve_bench_cuda.json" --plot "$OUTDIR/serve_bench_cuda.png"
step nccl 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/loader/test_loader_distributed.py
echo "device_check: done" | tee -a "$LOG"
