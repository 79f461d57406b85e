#!/usr/bin/env bash
# Make sure a Docker Engine answers on this machine: install Debian's docker.io if it is missing,
# start dockerd in the background if it is not running (there is no systemd here), wait until it
# answers. Idempotent: a second run only checks. Prints what it does.
#
#   tools/dev/image/docker-host.sh            # then: "$(tools/dev/image/docker-host.sh --client)" info
#   tools/dev/image/docker-host.sh --client   # print the docker client to use, and nothing else
#
# The client is Debian's /usr/bin/docker: it has BuildKit built in (DOCKER_BUILDKIT=1, needed for
# `RUN --mount=type=secret`). A newer client earlier on the PATH (e.g. /usr/local/bin/docker) would
# need the buildx plugin, which Debian does not package.
set -euo pipefail

DOCKER=${DOCKER:-/usr/bin/docker}
DOCKERD=${DOCKERD:-/usr/sbin/dockerd}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/dockerd.log}
WAIT_SECONDS=${DOCKERD_WAIT_SECONDS:-60}

if [ "${1:-}" = "--client" ]; then
    echo "$DOCKER"
    exit 0
fi

say() { echo "docker-host: $*" >&2; }

if [ ! -x "$DOCKER" ] || [ ! -x "$DOCKERD" ]; then
    say "installing Debian's docker.io (apt-get)"
    if [ "$(id -u)" -ne 0 ]; then
        say "not root: install docker.io yourself (sudo apt-get install -y docker.io), then rerun"
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
fi
say "client $("$DOCKER" --version)"

if "$DOCKER" info >/dev/null 2>&1; then
    say "dockerd already answers ($("$DOCKER" info --format '{{.ServerVersion}}, storage {{.Driver}}'))"
    exit 0
fi

if pgrep -x dockerd >/dev/null 2>&1; then
    say "dockerd is running but does not answer yet; waiting"
else
    say "starting dockerd in the background (log: $DOCKERD_LOG)"
    # setsid: dockerd must outlive this script and the make that runs it.
    setsid "$DOCKERD" >>"$DOCKERD_LOG" 2>&1 </dev/null &
fi

for _ in $(seq "$WAIT_SECONDS"); do
    if "$DOCKER" info >/dev/null 2>&1; then
        say "dockerd answers ($("$DOCKER" info --format '{{.ServerVersion}}, storage {{.Driver}}'))"
        exit 0
    fi
    sleep 1
done
say "dockerd did not answer within ${WAIT_SECONDS} s; last lines of $DOCKERD_LOG:"
tail -n 20 "$DOCKERD_LOG" >&2 || true
exit 1
