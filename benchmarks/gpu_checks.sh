#!/usr/bin/env bash
# Every check that needs a GPU, in one run on a CUDA machine (the device tool's):
#
#     bash benchmarks/gpu_checks.sh [OUT [STEP...]]   # logs and JSON under OUT (default gpu-checks/)
#
# STEP: machine, tests, gpu_dp, conv_mp_gpu (default: all, in this order). GPU_TESTS
# replaces the test files, GPU_DP_ARGS gpu_dp.py's arguments (--quick), GPU_DP_LIMIT its
# time limit in seconds (200).
#
# 1. what the machine is: nvidia-smi, torch, the MPI library mpi4py loads;
# 2. the CUDA tests the CI machine skips: a GPU rank beside CPU ranks in every
#    data-parallel strategy against one process, mixed precision, conv-MP's GPU
#    staging, and the local engine's real GPU inventory and leases (tests/test_gpus.py);
# 3. benchmarks/gpu_dp.py --quick: the GPU alone, the GPU with CPU ranks by measured
#    shares (with the planner's predictions), ours against torch DDP over NCCL;
# 4. benchmarks/conv_mp_gpu.py --all: the seed's GPU + CPU conv-MP case.
#
# Each step has its own time limit and a failed step does not stop the next. A machine
# without this project's dependencies (the device tool's is bare) gets them from wheels
# carried in .whl/ (python3.12 manylinux wheels of pydantic and its needs, mpi4py and
# mpich): everything but mpich goes to /tmp/site; mpich under a prefix of its own,
# because `pip --target` drops the lib/ that holds libmpi.so.12. To make them (.whl/ is
# git-ignored; the device tool's `carry: [".whl"]` takes it along):
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#         --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl pydantic==2.13.4 \
#         pydantic_core==2.46.4 annotated-types typing-inspection typing-extensions \
#         mpich==4.3.2 mpi4py==4.1.2
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-checks}
shift || true
only=" $* "
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $(ls .whl/*.whl | grep -v /mpich-) &&
    python3 -m pip install -q --ignore-installed --no-index --no-deps --no-compile --no-cache-dir \
        --prefix /tmp/mpich .whl/mpich-*.whl || { echo "gpu_checks: installing .whl/ failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    export MPI4PY_LIBMPI=/tmp/mpich/lib/libmpi.so.12
fi

step() {   # step NAME SECONDS COMMAND...: runs it with its log in OUT/NAME.log; its status (1 if not asked for)
    local name=$1 limit=$2; shift 2
    [ "$only" = "  " ] || [[ "$only" == *" $name "* ]] || return 1
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - t0))s"
    [ $rc = 0 ] || failed="$failed $name"
    return $rc
}

failed=""
step machine 30 bash -c 'nvidia-smi -L; nproc; python3 -c "
import sys, torch, mpi4py
from mpi4py import MPI
print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0), mpi4py.__version__)
print(MPI.Get_library_version().splitlines()[0])
import yarnapp, training, conf
"'
step tests 240 python3 -m pytest -q -p no:cacheprovider -rs --basetemp=/tmp/gpu-checks-tests \
    ${GPU_TESTS:-tests/test_devices.py tests/test_dp_devices.py tests/test_gpus.py \
                 tests/test_conv_mp.py::test_gpu_ranks_equal_single_process}
step gpu_dp "${GPU_DP_LIMIT:-200}" python3 benchmarks/gpu_dp.py ${GPU_DP_ARGS:---quick} --out "$out/gpu_dp.json"
step conv_mp_gpu 80 python3 benchmarks/conv_mp_gpu.py --all && cp benchmarks/results/conv_mp_gpu.json "$out/"
[ -z "$failed" ] || { echo "gpu_checks: failed:$failed"; exit 1; }
