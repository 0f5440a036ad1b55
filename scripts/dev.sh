#!/usr/bin/env bash
# One entry point that also does all set-up on a fresh machine:
#   bash scripts/dev.sh train [--nproc N] [hydra overrides...]  # CPU training recipe on N gloo ranks (default 2)
#   bash scripts/dev.sh test  [pytest args...]                  # the whole test-suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."

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
  .venv/bin/pip install -q "$TORCH" numpy
  .venv/bin/pip install -q -e ".[test]"
  echo "$wanted" > "$stamp"
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
  test) exec .venv/bin/python -m pytest -q "$@" ;;
  *) echo "usage: bash scripts/dev.sh {train [--nproc N]|test} [args...]" >&2; exit 2 ;;
esac
