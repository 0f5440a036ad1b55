#!/usr/bin/env bash
# Run the fake-backend, gloo and recipe-smoke tests against one or more torch releases, each in its
# own cached venv outside the clone:
#
#   bash scripts/matrix.sh 2.14.1 2.15.0            # what CI's matrix legs run
#   FSDP_REPLAY_MATRIX_K="not slow and not hydra" bash scripts/matrix.sh 2.15.0
#   bash scripts/matrix.sh 2.15.0 -- -x tests/fake  # everything after -- replaces the default pytest args
#
# Venvs live in ${FSDP_REPLAY_VENV_CACHE:-$HOME/.cache/fsdp_replay/venvs}/torch-<release>; a venv whose
# torch is already the requested release is reused (only the package itself is re-installed, editable,
# from this clone). Releases above the cap of this machine's pip constraints file (torch<=2.14.1) are
# installed with PIP_CONSTRAINT=/dev/null (an empty PIP_CONSTRAINT value does not lift it).
#
# Exit status: non-zero if any install, version check or test leg fails; a summary with each leg's
# wall time is printed at the end either way.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

CACHE="${FSDP_REPLAY_VENV_CACHE:-$HOME/.cache/fsdp_replay/venvs}"
SMOKE_K="${FSDP_REPLAY_MATRIX_K:-not slow}"
# The highest torch release the machine's pip constraints allow; above it the constraint is lifted.
CONSTRAINT_CAP="${FSDP_REPLAY_TORCH_CAP:-2.14.1}"

releases=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; break; fi
  releases+=("$1"); shift
done
pytest_args=("$@")
if [ ${#pytest_args[@]} -eq 0 ]; then
  pytest_args=(tests/fake tests/gloo tests/recipes -k "$SMOKE_K")
fi
if [ ${#releases[@]} -eq 0 ]; then
  echo "usage: bash scripts/matrix.sh RELEASE [RELEASE...] [-- PYTEST_ARGS...]   (e.g. 2.14.1 2.15.0)" >&2
  exit 2
fi

die() { echo "matrix.sh: ERROR: $*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }
# is_release 2.15.0+cu132 2.15.0 / is_release 2.15.1 2.15: the local-version suffix is ignored.
is_release() { local base=${1%%+*}; [ -n "$1" ] && { [ "$base" = "$2" ] || [[ "$base" == "$2".* ]]; }; }
version_gt() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -1)" = "$1" ]; }

# One release: set up (or reuse) its venv, then run the tests. Runs in a subshell so that a failure
# of one release does not stop the others; prints "SETUP_S TEST_S STATUS" on fd 3 for the summary.
run_release() {
  local release=$1 venv="$CACHE/torch-$1" t0 t1 t2 status=ok
  [[ "$release" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] || die "not a torch release: '$release' (want e.g. 2.15.0)"
  t0=$(now)
  echo "=== torch $release: venv $venv"
  mkdir -p "$CACHE" || die "cannot create $CACHE"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || die "python3 -m venv $venv failed"
  fi
  # "2.15" means the newest 2.15.x; "2.15.0" exactly that release.
  local spec="torch==$release" have env_prefix=()
  [[ "$release" =~ ^[0-9]+\.[0-9]+$ ]] && spec="torch==$release.*"
  if version_gt "$release" "$CONSTRAINT_CAP"; then
    env_prefix=(env PIP_CONSTRAINT=/dev/null)
  fi
  have=$("$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
  if ! is_release "$have" "$release"; then
    echo "--- installing $spec (found: ${have:-none})"
    "${env_prefix[@]}" "$venv/bin/pip" install -q "$spec" numpy \
      || die "pip could not install $spec into $venv (see pip's message above)"
    have=$("$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null) \
      || die "$spec installed but 'import torch' fails in $venv"
  fi
  is_release "$have" "$release" || die "$venv has torch ${have:-none}, not the requested $release"
  # What a user with this torch runs: the package and its test extra, with its own torch range. It
  # must keep the installed torch (checked below), never replace it.
  "${env_prefix[@]}" "$venv/bin/pip" install -q -e "$REPO[test]" || die "pip install -e $REPO[test] failed"
  have=$("$venv/bin/python" -c "import torch; print(torch.__version__)") || die "import torch fails after installing the package"
  is_release "$have" "$release" || die "installing the package changed torch to $have"
  t1=$(now)
  echo "--- torch $have: pytest -q ${pytest_args[*]}"
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$venv/bin/python" -m pytest -q -p no:cacheprovider "${pytest_args[@]}"
  local rc=$?
  t2=$(now)
  [ $rc -eq 0 ] || status="tests failed (pytest exit $rc)"
  echo "$(elapsed "$t0" "$t1") $(elapsed "$t1" "$t2") $status" >&3
  [ $rc -eq 0 ]
}

summary=()
failed=0
for release in "${releases[@]}"; do
  result_file=$(mktemp)
  (run_release "$release") 3>"$result_file"
  rc=$?
  read -r setup_s test_s status <"$result_file" || true
  rm -f "$result_file"
  if [ -z "${setup_s:-}" ]; then
    summary+=("torch $release: FAILED in set-up (see the error above)")
    failed=1
  else
    [ $rc -eq 0 ] || failed=1
    summary+=("torch $release: set-up ${setup_s}s, tests ${test_s}s: $status")
  fi
  unset setup_s test_s status
done

echo "=== matrix summary"
printf '%s\n' "${summary[@]}"
exit $failed
