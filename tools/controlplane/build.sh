#!/usr/bin/env bash
# Builds (or reuses) the real Kubernetes control plane the tests run against, and prints the
# folder that holds it: kube-apiserver, kube-controller-manager and kube-scheduler of the release
# this folder's go.mod pins, and the etcd that release pins (v3.6.8), built from the Go module
# proxy. Not Debian's etcd-server: its 3.4.23 lacks RequestWatchProgress, which kube-apiserver
# 1.36 needs for a watch from "now" with bookmarks (it answers such a watch with an ERROR event,
# and clients that watch that way, kwok's informers among them, see changes only on relists).
#
#   bin=$(tools/controlplane/build.sh)      # `make cluster-bin` runs it
#
# The binaries are cached outside the clone, in $COREFLEET_CACHE (default ~/.cache/corefleet),
# under a key of go.mod, go.sum and this script: a second run on the same machine, from any
# clone, reuses them. Go's own module and build caches make a rebuild after a change cheaper.
# A cold build on 2 cores takes most of the time `make test` spends on a new machine
# (docs/local-cluster.md has the figures).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${COREFLEET_CACHE:-$HOME/.cache/corefleet}"
release="$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$here/go.mod")"
key="$(cat "$here/go.mod" "$here/go.sum" "$0" | cksum | cut -d' ' -f1)"
out="$cache/controlplane/kubernetes-$release-$key"
tools=(kube-apiserver kube-controller-manager kube-scheduler)
etcd_module=go.etcd.io/etcd/server/v3

log() { echo "controlplane: $*" >&2; }

build_kubernetes() {
  command -v go >/dev/null || {
    log "Go is not installed: the control plane is built from the Go module proxy (go.dev/dl)"
    exit 1
  }
  local minor="${release#v1.}"
  minor="${minor%%.*}"
  local version_pkg ldflags=""
  # What `kube-apiserver --version` and /version say, as a release build's `make` sets them.
  for version_pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $version_pkg.gitVersion=$release -X $version_pkg.gitMajor=1"
    ldflags+=" -X $version_pkg.gitMinor=$minor -X $version_pkg.gitTreeState=clean"
  done
  log "building Kubernetes $release (${tools[*]}) and etcd into $out; on 2 cores this takes a while"
  local partial="$out.partial.$$"
  rm -rf "$partial"
  mkdir -p "$partial"
  (
    cd "$here"
    # CGO off: static binaries, as the release builds them; -mod=readonly: go.sum is the truth.
    CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w$ldflags" \
      -o "$partial/" "${tools[@]/#/k8s.io/kubernetes/cmd/}"
    CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w" \
      -o "$partial/etcd" "$etcd_module"
  )
  rm -rf "$out"
  mv "$partial" "$out"
}

[ -x "$out/etcd" ] || build_kubernetes
echo "$out"
