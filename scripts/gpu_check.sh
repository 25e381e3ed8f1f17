#!/usr/bin/env bash
# The GPU check in one command: the CUDA tests, merged against layer-wise codec times and
# training step times on one GPU; summary.json and summary.md in OUT_DIR; one verdict line last.
# About 2 minutes of checks on one H200 (stage budgets: 8 minutes); without a CUDA device, seconds (every CUDA test skips, exit 0).
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (default ./gpu_check_out)
set -euo pipefail
exec python "$(dirname "$0")/gpu_check.py" "$@"
