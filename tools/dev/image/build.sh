#!/usr/bin/env bash
# `make image`: build the serving image from container/Dockerfile, as CodeBuild does, on this machine.
#
#   VARIANT       cpu (default) or cuda
#   IMAGE         tag to build (default decider:$VARIANT)
#   PYTHON_IMAGE  base for the CPU variant. Empty (default): the local stand-in that
#                 tools/dev/image/base-images.sh makes from Debian's mirror, for machines that reach no
#                 image registry. Give a real image where a registry is reachable, e.g.
#                 PYTHON_IMAGE=public.ecr.aws/docker/library/python:3.11.14-slim-bookworm
#   CA_BUNDLE     PEM bundle that pip and apt trust during the build (a BuildKit secret: never in a
#                 layer). Default: pip's configured `cert` (`pip config get global.cert`), if any;
#                 CA_BUNDLE=none builds without one.
#
# Only the base image and the CA secret differ from CodeBuild's build; the Dockerfile is the same.
set -euo pipefail
cd "$(dirname "$0")/../../.."

VARIANT=${VARIANT:-cpu}
IMAGE=${IMAGE:-decider:$VARIANT}
PYTHON_IMAGE=${PYTHON_IMAGE:-}
CA_BUNDLE=${CA_BUNDLE:-auto}

say() { echo "image: $*" >&2; }

tools/dev/image/docker-host.sh
DOCKER=$(tools/dev/image/docker-host.sh --client)

build_args=(--build-arg "VARIANT=$VARIANT")
if [ "$VARIANT" = "cpu" ]; then
    if [ -z "$PYTHON_IMAGE" ]; then
        tools/dev/image/base-images.sh
        PYTHON_IMAGE=$(tools/dev/image/base-images.sh --print-python)
    fi
    build_args+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
fi

if [ "$CA_BUNDLE" = "auto" ]; then
    CA_BUNDLE=$( (python3 -m pip config get global.cert || true) 2>/dev/null | tail -n 1)
    CA_BUNDLE=${CA_BUNDLE:-${PIP_CERT:-}}
fi
secret_args=()
if [ -n "$CA_BUNDLE" ] && [ "$CA_BUNDLE" != "none" ]; then
    if [ ! -s "$CA_BUNDLE" ]; then
        say "CA_BUNDLE=$CA_BUNDLE is not a readable file"
        exit 1
    fi
    secret_args=(--secret "id=ca_bundle,src=$CA_BUNDLE")
    say "CA bundle for pip and apt during the build (BuildKit secret): $CA_BUNDLE"
fi

say "building $IMAGE (VARIANT=$VARIANT${PYTHON_IMAGE:+, PYTHON_IMAGE=$PYTHON_IMAGE})"
started=$(date +%s)
DOCKER_BUILDKIT=1 "$DOCKER" build --progress=plain "${build_args[@]}" "${secret_args[@]}" \
    -t "$IMAGE" container/
elapsed=$(($(date +%s) - started))
size=$("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE")
say "built $IMAGE in $((elapsed / 60)) min $((elapsed % 60)) s: $("$DOCKER" image inspect --format '{{.Id}}' "$IMAGE"), $((size / 1024 / 1024)) MiB"
