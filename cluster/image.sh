#!/usr/bin/env bash
# The cluster image: its one name and tag, and how to build and push it (from any directory).
#
#   cluster/image.sh tag     # prints it; cluster/aws.yaml and cluster/kuberay/*.yaml name the same
#   cluster/image.sh build   # builds the repository's Dockerfile (BuildKit) for linux/amd64
#   cluster/image.sh push    # pushes it; log in to the registry first (e.g. `aws ecr get-login-password`)
#
# Use your registry: replace registry.example.com here and in the configs (a test checks they agree).
# The tag says what is inside: vitpipe's version, then Ray's, Python's and the base image's CUDA,
# all as in the Dockerfile.
set -euo pipefail

IMAGE=registry.example.com/vitpipe:0.1.0-ray2.60.0-py311-cu128
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

case "${1:-}" in
  tag) echo "$IMAGE" ;;
  # The locks are for x86_64 Linux: build for it on any machine, Apple silicon included.
  build) DOCKER_BUILDKIT=1 docker build --platform linux/amd64 --tag "$IMAGE" "$ROOT" ;;
  push) docker push "$IMAGE" ;;
  *) echo "usage: $0 tag | build | push" >&2; exit 2 ;;
esac
