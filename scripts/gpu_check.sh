#!/usr/bin/env bash
# Every GPU check of fsdp_replay in one command, for one lent GPU (an H200 with torch 2.11, minutes of time):
#   1. tests/gpu (the one-GPU CUDA tier; the 2-GPU tests skip), under 3 minutes;
#   2. python bench/bench.py suite=gpu_link at 50 and 100 GB/s (one GPU, emulated link), under 4 minutes.
# Logs and results go to $OUT when set (the device tool brings that folder back), else outputs/gpu_check/:
# env.txt, tests_gpu.log, gpu_link.log, gpu_link_table.md, gpu_link_results.json (5 files, no subfolders).
#
# The GPU image has torch, pytest, pyyaml, matplotlib and tqdm, but not hydra-core / omegaconf / antlr4,
# and nothing installs there. Once, on a machine with pip (the folder is git-ignored, ~2.3 MB, pure Python
# so any Python 3 will do; antlr4-python3-runtime 4.9.3 is an sdist only, hence install --target rather than
# download):
#   python3 -m pip install --no-deps --no-compile --target .gpu_site hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
# then carry it with the command, e.g. the device tool's run(command="bash scripts/gpu_check.sh",
# carry=[".gpu_site"], timeout_s=600). Rehearse on CPU first (GPU tests skip, the suite runs its plumbing):
#   OUT=/tmp/gpu_out bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-outputs/gpu_check}"
mkdir -p "$OUT"
# This checkout's .venv where it has one (a developer machine), else the image's python3.
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export PYTHONPATH="$PWD:$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

{
  date -u
  "$PYTHON" -c "import torch, fsdp_replay._compat as c; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', '| fsdp_replay internals', c.INTERNALS_OK)"
  "$PYTHON" -c "import hydra, omegaconf; print('hydra', hydra.__version__, '| omegaconf', omegaconf.__version__)" \
    || echo "hydra/omegaconf missing: carry .gpu_site (see this script's header)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
} 2>&1 | tee "$OUT/env.txt"
has_cuda="$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)"

status=0
start=$SECONDS
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$OUT/tests_gpu.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || status=1
echo "gpu_check: tests/gpu took $((SECONDS - start)) s (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))" | tee -a "$OUT/tests_gpu.log"

# Without CUDA (a rehearsal) the suite runs its plumbing: tiny sizes, no link.
plumbing=$([ "$has_cuda" = 1 ] || echo "bench.quick=true")
run_dir="$(mktemp -d)"
start=$SECONDS
timeout 330 "$PYTHON" bench/bench.py suite=gpu_link 'gpu_link.bandwidth_gbps=[50,100]' $plumbing \
  "hydra.run.dir=$run_dir" hydra.output_subdir=null 2>&1 | tee "$OUT/gpu_link.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || status=1
echo "gpu_check: suite=gpu_link took $((SECONDS - start)) s (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))" | tee -a "$OUT/gpu_link.log"
for f in table.md results.json; do
  [ -f "$run_dir/$f" ] && cp "$run_dir/$f" "$OUT/gpu_link_$f"
done
rm -rf "$run_dir"

echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED), results in $OUT"
exit $status
