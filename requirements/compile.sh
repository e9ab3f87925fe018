#!/usr/bin/env bash
# Regenerates the runtime locks from pyproject.toml (dependencies + the video and bayes extras),
# for Python 3.11 on Linux x86_64. Run from the repository root after changing dependencies:
#
#   pip install uv
#   requirements/compile.sh                              # keeps every pin that is still allowed
#   requirements/compile.sh --upgrade-package mlflow     # moves one pin; --upgrade moves them all
#
#   cuda.txt  the cluster image (Dockerfile): torch from PyPI, whose Linux wheel is the CUDA build
#   cpu.txt   CPU-only machines (laptops, CI): the same pins with PyTorch's CPU-only torch
#
# uv keeps the versions already in a lock unless told to upgrade, so regenerating is stable.
# TORCH_CPU_SOURCE is where the CPU torch comes from: PyTorch's CPU index by default; a folder of
# wheels works too (TORCH_CPU_SOURCE="--find-links DIR"), e.g. where that index is out of reach.
set -euo pipefail
cd "$(dirname "$0")/.."

# Wheels only: the image installs the locked files as they are, checked against these hashes.
common=(pyproject.toml --extra video --extra bayes
        --python-version 3.11 --python-platform x86_64-manylinux_2_28 --only-binary :all:
        --generate-hashes --custom-compile-command "requirements/compile.sh" "$@")
# shellcheck disable=SC2206  # TORCH_CPU_SOURCE is an option and its value: split on purpose
cpu_source=(${TORCH_CPU_SOURCE:---torch-backend cpu})

uv pip compile "${common[@]}" --output-file requirements/cuda.txt
uv pip compile "${common[@]}" "${cpu_source[@]}" --output-file requirements/cpu.txt
