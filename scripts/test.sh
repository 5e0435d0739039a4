#!/usr/bin/env bash
# Set up, then run the test suite (CPU; GPU tests are marked `gpu` and skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Two worker processes (pytest-xdist) of one thread each: on a 2-core machine like CI's the suite
# takes 303-336 s instead of 534 in one process of two threads, since much of it waits on
# subprocesses, servers and compilers (tests that must not overlap take a lock: the sandbox's,
# tests/posttrain/conftest.py). `bash scripts/test.sh -n 0` runs it in one process;
# OMP_NUM_THREADS set outside wins.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest -n 2 "$@"
