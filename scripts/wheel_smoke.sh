#!/usr/bin/env bash
# `make wheel-smoke`: build the sdist and the wheel as a user would (`python -m build`: the
# sdist from the checkout, then the wheel from the unpacked sdist, so neither build/ nor a
# stale egg-info of the checkout can reach it), check both archives' file lists, install
# the wheel with its declared dependencies and Paddle into a fresh .venv-wheel, and run the
# smoke from a directory outside the checkout (scripts/wheel_smoke.py says what it checks).
#   PYTHON_BOOT  the Python 3.11 to create the venvs with (default python3.11)
#   PADDLE_PIN   the Paddle to install next to the wheel (default paddlepaddle==3.3.1, CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON_BOOT=${PYTHON_BOOT:-python3.11}
PADDLE_PIN=${PADDLE_PIN:-paddlepaddle==3.3.1}
VENV=.venv-wheel
started=$SECONDS

work=$(mktemp -d "${TMPDIR:-/tmp}/fdrr-wheel-smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "== build: python -m build (sdist, then the wheel from the sdist) into dist/"
"$PYTHON_BOOT" -m venv "$work/build-env"
"$work/build-env/bin/python" -m pip install -q --upgrade pip build
rm -f dist/fd_routing_replay-*
"$work/build-env/bin/python" -m build --outdir dist . > "$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log"; echo "FAIL python -m build"; exit 1; }
tail -1 "$work/build.log"
"$work/build-env/bin/python" scripts/wheel_smoke.py check-dist dist

echo "== install: a fresh $VENV with $PADDLE_PIN and the wheel (its declared dependencies)"
rm -rf "$VENV"
"$PYTHON_BOOT" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$PADDLE_PIN" dist/fd_routing_replay-*.whl
echo "   $(( SECONDS - started )) s so far"

echo "== smoke: from $work/run, outside the checkout"
mkdir "$work/run"
(cd "$work/run" && env -u PYTHONPATH "$ROOT/$VENV/bin/python" "$ROOT/scripts/wheel_smoke.py" installed "$work/run")
echo "wheel smoke passed in $(( SECONDS - started )) s"
