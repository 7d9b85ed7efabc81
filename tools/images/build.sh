#!/usr/bin/env bash
# `make images`: the operator and engine images from the Dockerfile, tagged as every manifest
# names them (ghcr.io/corefleet/corefleet-operator:<version>, ghcr.io/corefleet/corefleet:<version>,
# the version from pyproject.toml), into the local Docker engine (started if none runs).
#
# BASE_IMAGE: the base of every stage. Unset, the base is made here from Debian's packages
# (base.sh), for machines that reach no image registry; BASE_IMAGE=python:3.11-slim-bookworm
# builds on the public one.
#
# The classic builder (DOCKER_BUILDKIT=0): Debian's docker.io 20.10 has no buildx, and the
# Dockerfile needs no BuildKit feature. Its layer cache makes a rebuild after a code change
# redo only the wheel and the layers above it.
set -euo pipefail
cd "$(dirname "$0")/../.."

tools/images/dockerd.sh
base=${BASE_IMAGE:-$(tools/images/base.sh)}
version=$(python3 -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
export DOCKER_BUILDKIT=0
for target in operator engine; do
    case $target in
        operator) tag=ghcr.io/corefleet/corefleet-operator:$version ;;
        engine) tag=ghcr.io/corefleet/corefleet:$version ;;
    esac
    echo "image $tag (target $target, base $base)" >&2
    start=$(date +%s)
    docker build --quiet --target "$target" --build-arg BASE_IMAGE="$base" -t "$tag" . >&2
    echo "image $tag built in $(( $(date +%s) - start )) s" >&2
done
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' 'ghcr.io/corefleet/*' >&2
