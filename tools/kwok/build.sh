#!/usr/bin/env bash
# Builds (or reuses) KWOK's controller, `kwok`, and prints the folder that holds it: the binary
# of the release this folder's go.mod pins, built from the Go module proxy, `stages.yaml`, the
# Stages kwokctl gives that release by default (node-initialize, node-heartbeat-with-lease,
# pod-ready, pod-complete, pod-delete), copied from the same module, and `etcd` (v3.6.8; go.mod
# says why the control plane's Debian etcd does not do for kwok). The bare `kwok` binary has no
# built-in Stages: pass the file with `--config`.
#
#   bin=$(tools/kwok/build.sh)      # `make kwok-bin` runs it
#   "$bin/kwok" --kubeconfig=... --config="$bin/stages.yaml" --manage-all-nodes=false \
#     --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake
#
# KWOK fakes nodes and the lifecycle of the pods bound to them against a real API server; it
# runs no container. benchmarks/operator_scale.py uses it. One fix is applied at build time, to
# a copy of the module that a `replace` in a build-only copy of go.mod points at (`go build
# -modfile`; go.mod, go.sum and the module cache are untouched): kwok v0.8.0 deletes a
# terminating pod by name alone, so a delete queued for a pod that is gone kills the next pod of
# the same name, as the operator's rank pods (`<engine>-engine-<rank>`) are named; the kubelet
# deletes with the pod's UID as a precondition (kubernetes#25224), and so does the patched kwok.
# The cache works as in tools/controlplane/build.sh: $COREFLEET_CACHE (default
# ~/.cache/corefleet), under a key of go.mod, go.sum and this script. A cold build on 2 cores
# takes a few minutes (less after tools/controlplane/build.sh: they share Go's caches).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${COREFLEET_CACHE:-$HOME/.cache/corefleet}"
release="$(awk '$1 == "sigs.k8s.io/kwok" {print $2}' "$here/go.mod")"
key="$(cat "$here/go.mod" "$here/go.sum" "$0" | cksum | cut -d' ' -f1)"
out="$cache/kwok/$release-$key"
# kwokctl's default Stages (pkg/kwokctl/runtime/cluster.go: getDefaultNodeStages with a node
# lease, getDefaultPodStages), as paths inside the module.
stages=(
  kustomize/stage/node/fast/node-initialize.yaml
  kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
  kustomize/stage/pod/fast/pod-ready.yaml
  kustomize/stage/pod/fast/pod-complete.yaml
  kustomize/stage/pod/fast/pod-delete.yaml
)

log() { echo "kwok: $*" >&2; }

# kwok's pod_controller.go with the pod delete made conditional on the pod's UID; a delete that
# finds the pod gone (404) or the name taken by a newer pod (409) has nothing left to do.
patch_pod_delete() {
  local call='err := c.typedClient.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, deleteOpt)'
  grep -qF "$call" "$1" || {
    log "$1 does not have the line the UID fix replaces: check the fix against this release"
    exit 1
  }
  awk -v call="$call" '
    index($0, call) {
      print "\topt := deleteOpt"
      print "\topt.Preconditions = metav1.NewUIDPreconditions(string(pod.UID))"
      print "\terr := c.typedClient.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, opt)"
      print "\tif apierrors.IsNotFound(err) || apierrors.IsConflict(err) {"
      print "\t\treturn nil"
      print "\t}"
      next
    }
    /^import \($/ { print; print "\tapierrors \"k8s.io/apimachinery/pkg/api/errors\""; next }
    { print }
  ' "$1"
}

build_kwok() {
  command -v go >/dev/null || {
    log "Go is not installed: kwok is built from the Go module proxy (go.dev/dl)"
    exit 1
  }
  log "building kwok $release and etcd into $out"
  local partial="$out.partial.$$" module stage source
  rm -rf "$partial"
  mkdir -p "$partial"
  (
    cd "$here"
    module="$(GOFLAGS=-mod=readonly go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
    source=pkg/kwok/controllers/pod_controller.go
    cp -r "$module" "$partial/kwok-src"
    chmod -R u+w "$partial/kwok-src"
    patch_pod_delete "$module/$source" >"$partial/kwok-src/$source"
    cp go.mod "$partial/build.mod"
    cp go.sum "$partial/build.sum"
    echo "replace sigs.k8s.io/kwok => $partial/kwok-src" >>"$partial/build.mod"
    # CGO off: a static binary, as the release builds it; -mod=readonly: go.sum is the truth.
    CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w" \
      -modfile="$partial/build.mod" -o "$partial/" sigs.k8s.io/kwok/cmd/kwok
    rm -rf "$partial/kwok-src" "$partial/build.mod" "$partial/build.sum"
    CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w" \
      -o "$partial/etcd" go.etcd.io/etcd/server/v3
    for stage in "${stages[@]}"; do
      echo "---"
      echo "# $release: $stage"
      cat "$module/$stage"
    done >"$partial/stages.yaml"
  )
  rm -rf "$out"
  mv "$partial" "$out"
}

[ -x "$out/kwok" ] && [ -x "$out/etcd" ] && [ -s "$out/stages.yaml" ] || build_kwok
echo "$out"
