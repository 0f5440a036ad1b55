#!/usr/bin/env bash
# One entry point that also does all set-up on a fresh machine:
#   bash scripts/dev.sh train [hydra overrides...]   # CPU training recipe, 2 ranks on gloo
#   bash scripts/dev.sh test  [pytest args...]       # the whole test-suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch first and pinned: an unpinned requirement may pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch, numpy, fsdp_replay, hydra, tqdm, pytest, hypothesis" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0 numpy
  .venv/bin/pip install -q -e ".[test]"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

command="${1:-}"
shift || true
case "$command" in
  train)
    # One process checks the overrides first: a bad value is reported once, not by every rank
    # and then again inside torchrun's ChildFailedError traceback.
    .venv/bin/python recipes/train.py --validate-only "$@"
    exec .venv/bin/torchrun --standalone --nproc-per-node 2 recipes/train.py "$@" ;;
  test) exec .venv/bin/python -m pytest -q "$@" ;;
  *) echo "usage: bash scripts/dev.sh {train|test} [args...]" >&2; exit 2 ;;
esac
