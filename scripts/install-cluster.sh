#!/usr/bin/env bash
# Build the real Kubernetes control plane the tests run against, from pinned Go modules.
#
#   scripts/cluster/kubernetes/go.mod : kube-apiserver, kube-controller-manager, kube-scheduler
#                                       (k8s.io/kubernetes, every k8s.io staging module replaced by its
#                                       matching v0.x release: the usual way to build k8s as a dependency)
#   scripts/cluster/etcd/go.mod       : etcd (go.etcd.io/etcd/server/v3)
#   scripts/cluster/kwok/go.mod       : kwok (fake nodes and pod lifecycles)
#   scripts/cluster/kuberay/go.mod    : the KubeRay operator; its CRDs are copied from the module
#   scripts/cluster/kueue/go.mod      : Kueue (queueing and gang admission); its CRDs and webhook
#                                       configurations are copied from the module into kueue/
#   scripts/cluster/lws/go.mod        : LeaderWorkerSet (multi-node engine replicas); its CRD and webhook
#                                       configurations are copied from the module into lws/
#
# Each go.mod (with its go.sum) is the one pin of its component. Binaries land in
# DIR/k8s-<kubernetes version>/bin and are rebuilt only when what builds them changes, so the build runs
# once per version; after the first build it is offline (Go's module cache). No binary download, no
# docker: the ordinary `go` client only.
#
# Stamps, one per part, each the hash of the Go toolchain and that part's inputs only:
#   .stamp-core   the core go.mod/go.sum files and scripts/cluster/core.sh (the core's recipe)
#   .stamp-kueue  scripts/cluster/kueue/go.mod + go.sum
#   .stamp-lws    scripts/cluster/lws/go.mod + go.sum and build_lws below
# so adding or bumping an add-on, or editing this script, never rebuilds the core (~15 min on 2 cores).
#
# Usage: bash scripts/install-cluster.sh [DIR]   (default .tools); prints the directory it built.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SRC="$ROOT/scripts/cluster"
DIR="${1:-$ROOT/.tools}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

log() { printf '[install-cluster] %s\n' "$*" >&2; }
die() { printf '[install-cluster] ERROR: %s\n' "$*" >&2; exit 1; }

command -v go >/dev/null || die "Go is required (go 1.25 or newer on PATH) to build the control plane"

# One build at a time per tree: test sessions of several checkouts share one .tools (R3_CLUSTER_TOOLS) and
# each runs this script; a second one waits for the first, then finds the stamps fresh.
if command -v flock >/dev/null; then
  exec 9>"$DIR/.install-cluster.lock"
  flock 9
fi

pinned() {  # pinned MODULE-DIR MODULE-PATH -> version required in that go.mod
  local v
  v="$(awk -v m="$2" '$1 == m && $2 ~ /^v/ {print $2; exit}' "$SRC/$1/go.mod")"
  [[ -n "$v" ]] || die "scripts/cluster/$1/go.mod does not require $2"
  printf '%s' "$v"
}

K8S_VERSION="$(pinned kubernetes k8s.io/kubernetes)"
KUEUE_VERSION="$(pinned kueue sigs.k8s.io/kueue)"
LWS_VERSION="$(pinned lws sigs.k8s.io/lws)"
OUT="$DIR/k8s-$K8S_VERSION"
BIN="$OUT/bin"
GOVERSION="$(go env GOVERSION)"
# shellcheck source=cluster/core.sh
source "$SRC/core.sh"

hash_of() { (echo "$GOVERSION"; cat "$@") | sha256sum | cut -c1-16; }
module_files() { local c; for c in "$@"; do printf '%s\n' "$SRC/$c/go.mod" "$SRC/$c/go.sum"; done; }
fresh() { [[ -f "$OUT/$1" && "$(cat "$OUT/$1")" == "$2" ]]; }

mapfile -t core_inputs < <(module_files "${CORE_COMPONENTS[@]}")
want_core="$(hash_of "${core_inputs[@]}" "$SRC/core.sh")"
want_kueue="$(hash_of "$SRC/kueue/go.mod" "$SRC/kueue/go.sum")"

adopt_legacy_core() {
  # A tree built before the core had a stamp of its own (.stamp hashed the whole install script) is
  # adopted when its versions.txt names exactly the core pins and Go of now: same inputs, no rebuild.
  [[ -f "$OUT/.stamp" && -f "$OUT/versions.txt" && ! -f "$OUT/.stamp-core" ]] || return 1
  local line
  for line in "kubernetes $K8S_VERSION" "etcd $(pinned etcd go.etcd.io/etcd/server/v3)" \
              "kwok $(pinned kwok sigs.k8s.io/kwok)" \
              "kuberay $(pinned kuberay github.com/ray-project/kuberay/ray-operator)" "go $GOVERSION"; do
    grep -qxF "$line" "$OUT/versions.txt" || return 1
  done
  log "adopting the core built by the previous recipe in $OUT (same pins, same Go)"
  echo "$want_core" >"$OUT/.stamp-core"
}

build_go_tool() {  # build_go_tool MODULE-DIR PACKAGE OUTPUT LDFLAGS
  (cd "$SRC/$1" && CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--mod=mod}" go build -trimpath -p "${GO_BUILD_JOBS:-2}" \
    -ldflags "-s -w $4" -o "$BIN/$3" "$2")
}

module_dir() { (cd "$SRC/$1" && go list -m -f '{{.Dir}}' "$2"); }

build_kueue() {
  log "building Kueue $KUEUE_VERSION"
  mkdir -p "$BIN" "$OUT/kueue/crds"
  build_go_tool kueue sigs.k8s.io/kueue/cmd/kueue kueue "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
  local dir
  dir="$(module_dir kueue sigs.k8s.io/kueue)"
  install -m 0644 "$dir"/config/components/crd/bases/kueue.x-k8s.io_*.yaml "$OUT/kueue/crds/"
  # The webhook configurations as the module has them (service and ports are filled in at start).
  install -m 0644 "$dir/config/components/webhook/manifests.yaml" "$OUT/kueue/webhooks.yaml"
  echo "$want_kueue" >"$OUT/.stamp-kueue"
}

build_lws() {
  log "building LeaderWorkerSet $LWS_VERSION"
  mkdir -p "$BIN" "$OUT/lws/crds"
  build_go_tool lws sigs.k8s.io/lws/cmd lws "-X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION"
  local dir
  dir="$(module_dir lws sigs.k8s.io/lws)"
  install -m 0644 "$dir"/config/crd/bases/leaderworkerset.x-k8s.io_*.yaml "$OUT/lws/crds/"
  # The webhook configurations before kustomize: the objectSelector of the pod webhooks (its
  # config/webhook patches) and the service are filled in at start.
  install -m 0644 "$dir/config/webhook/manifests.yaml" "$OUT/lws/webhooks.yaml"
  echo "$want_lws" >"$OUT/.stamp-lws"
}

# LWS's stamp also covers its recipe (build_lws, below), so a change to what is copied rebuilds it.
# Kueue's covers its go.mod/go.sum alone, as the trees built before these stamps have it.
want_lws="$(hash_of "$SRC/lws/go.mod" "$SRC/lws/go.sum" <(declare -f build_lws))"

start=$SECONDS
built=()
if ! fresh .stamp-core "$want_core" && ! adopt_legacy_core; then
  build_core
  echo "$want_core" >"$OUT/.stamp-core"
  built+=(core)
fi
if ! fresh .stamp-kueue "$want_kueue"; then build_kueue; built+=(kueue); fi
if ! fresh .stamp-lws "$want_lws"; then build_lws; built+=(lws); fi

versions="kubernetes $K8S_VERSION
etcd $(pinned etcd go.etcd.io/etcd/server/v3)
kwok $(pinned kwok sigs.k8s.io/kwok)
kuberay $(pinned kuberay github.com/ray-project/kuberay/ray-operator)
kueue $KUEUE_VERSION
lws $LWS_VERSION
go $GOVERSION"
# Written only when it changes: the tree is shared by concurrent test runs, which all call this script.
[[ -f "$OUT/versions.txt" && "$(cat "$OUT/versions.txt")" == "$versions" ]] || echo "$versions" >"$OUT/versions.txt"
if ((${#built[@]} == 0)); then
  log "up to date: $OUT"
else
  log "built ${built[*]} in $((SECONDS - start)) s into $OUT ($(du -sh "$OUT" | cut -f1)):"
  sed 's/^/[install-cluster]   /' "$OUT/versions.txt" >&2
fi
echo "$OUT"
