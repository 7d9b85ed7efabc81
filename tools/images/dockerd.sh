#!/usr/bin/env bash
# Makes sure a Docker engine answers: installs Debian's docker.io (dockerd, containerd, runc)
# and debootstrap where they are missing, and starts dockerd if none runs. Needs root. The
# daemon keeps running afterwards (its image store, /var/lib/docker, is the build cache that
# makes a second `make images` on the machine take seconds).
set -euo pipefail

if docker info >/dev/null 2>&1; then
    exit 0
fi
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} from Debian's packages" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${missing[@]}" >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q "${missing[@]}" >&2; }
fi
log=/var/log/corefleet-dockerd.log
echo "starting dockerd (log: $log)" >&2
nohup dockerd >"$log" 2>&1 &
for _ in $(seq 120); do
    if docker info >/dev/null 2>&1; then
        exit 0
    fi
    sleep 0.5
done
echo "dockerd did not answer within 60 s; the end of $log:" >&2
tail -n 20 "$log" >&2
exit 1
