#!/usr/bin/env bash
# Local stand-ins for the image's base, for machines that reach Debian's package mirror but no
# image registry (Docker Hub, ECR Public, nvcr.io). Idempotent: an image already present is kept
# (--force rebuilds both). Prints what it does; prints nothing on stdout but, with --print-python,
# the name of the Python stand-in.
#
#   1. decider-local/debian:bookworm-minbase  `debootstrap --variant=minbase bookworm`, imported
#                                             with `docker import` (about 30 s, ~90 MB)
#   2. decider-local/python:3.11-bookworm     that root file system plus Debian's python3.11,
#                                             python3.11-venv and ca-certificates, with `python` and
#                                             `python3` on the PATH as in the official python image
#
# Pass the second one as the Dockerfile's PYTHON_IMAGE build argument (`make image` does). The
# Dockerfile's defaults stay the real public images that CodeBuild pulls.
set -euo pipefail

DOCKER=${DOCKER:-/usr/bin/docker}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
MINBASE_IMAGE=decider-local/debian:bookworm-minbase
PYTHON_IMAGE=decider-local/python:3.11-bookworm

say() { echo "base-images: $*" >&2; }

force=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        --print-python) echo "$PYTHON_IMAGE"; exit 0 ;;
        *) say "unknown argument $arg (use --force or --print-python)"; exit 2 ;;
    esac
done

have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

if [ "$force" -eq 0 ] && have_image "$MINBASE_IMAGE"; then
    say "$MINBASE_IMAGE is present"
else
    if ! command -v debootstrap >/dev/null 2>&1; then
        say "installing debootstrap (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    fi
    rootfs=$(mktemp -d /tmp/decider-minbase.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    say "debootstrap --variant=minbase $SUITE from $MIRROR (about 30 s)"
    started=$(date +%s)
    debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || {
        tail -n 20 "$rootfs.log" >&2
        exit 1
    }
    rm -f "$rootfs.log"
    # The same suites as the official Debian images: the release, its updates and security.
    cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
EOF
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    say "importing it as $MINBASE_IMAGE"
    tar -C "$rootfs" -c . | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["bash"]' \
        - "$MINBASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
    say "$MINBASE_IMAGE built in $(($(date +%s) - started)) s"
fi

if [ "$force" -eq 0 ] && have_image "$PYTHON_IMAGE"; then
    say "$PYTHON_IMAGE is present"
else
    say "building $PYTHON_IMAGE (Debian's python3.11 on $MINBASE_IMAGE)"
    DOCKER_BUILDKIT=1 "$DOCKER" build --quiet -t "$PYTHON_IMAGE" - >/dev/null <<EOF
FROM $MINBASE_IMAGE
RUN apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
        python3.11 python3.11-venv ca-certificates \\
    && rm -rf /var/lib/apt/lists/* \\
    && ln -s /usr/bin/python3.11 /usr/local/bin/python \\
    && ln -s /usr/bin/python3.11 /usr/local/bin/python3
CMD ["python3"]
EOF
    say "$PYTHON_IMAGE: $("$DOCKER" run --rm "$PYTHON_IMAGE" python --version)"
fi
