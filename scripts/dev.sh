#!/usr/bin/env bash
# One entry point that also does all set-up on a fresh machine (a .venv in the checkout):
#   bash scripts/dev.sh train [--nproc N] [hydra overrides...]  # CPU training recipe on N gloo ranks (default 2)
#   bash scripts/dev.sh test  [pytest args...]                  # the whole test-suite on this torch (no args)
#   bash scripts/dev.sh test --quick [pytest args...]           # the quick tier (QUICK_TESTS), about 2 minutes
#   bash scripts/dev.sh bench [hydra overrides...]              # bench/bench.py, e.g. bench.quick=true
#   bash scripts/dev.sh python [args...]                        # the venv's python, e.g. bench/bench_calls.py
#   bash scripts/dev.sh torchrun [args...]                      # the venv's torchrun
#   bash scripts/dev.sh help                                    # this list
# TORCH_INDEX_URL=<index> picks where torch comes from on the first set-up (e.g. PyTorch's CPU-only wheels).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: bash scripts/dev.sh {train|test|bench|python|torchrun|help} [args...]"
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}/  /'
}

# The quick tier: no process group, the fake backend, and one gloo module that runs every workload
# in every mode against plain FSDP2 (about 2 minutes on 2 busy cores; README "Tests" has the measured times).
QUICK_TESTS=(tests/unit tests/fake tests/docs tests/recipes/test_configs.py tests/recipes/test_report.py
  tests/gloo/test_workloads.py)

# torch first and pinned: an unpinned requirement may pull a multi-GB CUDA build.
TORCH=torch==2.13.0
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Install only when what would be installed changed (the pin or pyproject.toml), instead of
# importing torch on every call to find out; `rm .venv/.dev-stamp` forces a reinstall.
stamp=.venv/.dev-stamp
wanted="$({ echo "$TORCH"; cat pyproject.toml; } | cksum)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  echo "scripts/dev.sh: installing $TORCH and fsdp_replay[test] (editable) into .venv;" \
    "2-4 minutes the first time, later only when pyproject.toml or the torch pin changes" >&2
  .venv/bin/pip install -q "$TORCH" numpy ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  .venv/bin/pip install -q -e ".[test]"
  echo "$wanted" > "$stamp"
  echo "scripts/dev.sh: .venv is ready" >&2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

command="${1:-}"
shift || true
case "$command" in
  train)
    # --nproc is dev.sh's own (torchrun's ranks); everything else goes to Hydra.
    nproc=2
    overrides=()
    while [ $# -gt 0 ]; do
      case "$1" in
        --nproc | --nproc-per-node) nproc="${2:-}"; shift $(($# > 1 ? 2 : 1)) ;;
        --nproc=* | --nproc-per-node=*) nproc="${1#*=}"; shift ;;
        *) overrides+=("$1"); shift ;;
      esac
    done
    if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
      echo "scripts/dev.sh: --nproc takes a number of ranks >= 1, got '$nproc'" >&2
      exit 2
    fi
    # One process checks the overrides first: a bad value is reported once, not by every rank
    # and then again inside torchrun's ChildFailedError traceback. (The +-expansion keeps an
    # empty list legal under set -u on bash < 4.4.)
    .venv/bin/python recipes/train.py --validate-only ${overrides[@]+"${overrides[@]}"}
    exec .venv/bin/torchrun --standalone --nproc-per-node "$nproc" recipes/train.py ${overrides[@]+"${overrides[@]}"} ;;
  test)
    if [ "${1:-}" = --quick ]; then
      shift
      exec .venv/bin/python -m pytest -q "${QUICK_TESTS[@]}" "$@"
    fi
    exec .venv/bin/python -m pytest -q "$@" ;;
  bench) exec .venv/bin/python bench/bench.py "$@" ;;
  python) exec .venv/bin/python "$@" ;;
  torchrun) exec .venv/bin/torchrun "$@" ;;
  help | -h | --help) usage ;;
  *) usage >&2; exit 2 ;;
esac
