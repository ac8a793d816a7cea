#!/usr/bin/env bash
# The Helm chart (deploy/helm/sandbox-host): `helm lint --strict`, then `helm template` in each
# way /dev/kvm can reach a pod and with a token Secret made or named, each rendering validated
# against the Kubernetes API's schemas (1.29, strict: an unknown field or a wrong type fails,
# and so does any warning such as an unknown kind); and the chart's own refusals. The tools
# come from scripts/k8s-tools.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
chart=$root/deploy/helm/sandbox-host
kube=1.29.0
set +e
bin=$(bash "$root/scripts/k8s-tools.sh")
rc=$?
set -e
if [ $rc -eq 3 ]; then
  echo "skipped: the Helm chart's check needs Helm, which this machine's registries offer for x86_64 only"
  exit 0
fi
[ $rc -eq 0 ] || exit $rc
export PATH="$bin:$PATH"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export HELM_CACHE_HOME=$work/cache HELM_CONFIG_HOME=$work/config HELM_DATA_HOME=$work/data
token=0123456789abcdef0123456789abcdef
fail() { echo "helm chart: $*" >&2; exit 1; }

helm lint --strict --kube-version "$kube" "$chart" --set token.value=$token >&2
for args in "--set token.value=$token" \
            "--set token.value=$token --set host.kvm.mode=hostpath" \
            "--set token.existingSecret=their-secret" \
            "--set token.value=$token --set tls.existingSecret=their-tls"; do
  # shellcheck disable=SC2086
  helm template t "$chart" --namespace sbx --kube-version "$kube" $args > "$work/out.yaml"
  kubernetes-validate --strict --quiet -k "$kube" "$work/out.yaml" > "$work/v.log" 2>&1 || true
  [ ! -s "$work/v.log" ] || { cat "$work/v.log" >&2; fail "the rendering with $args is not valid Kubernetes $kube"; }
  for kind in DaemonSet Deployment PodDisruptionBudget Service; do
    grep -q "^kind: $kind$" "$work/out.yaml" || fail "no $kind with $args"
  done
done
# What the rendering must say (the default values).
helm template t "$chart" --namespace sbx --kube-version "$kube" --set token.value=$token > "$work/out.yaml"
for want in 'sandbox-host/kvm: "true"' 'devices.kubevirt.io/kvm: "1"' 'terminationGracePeriodSeconds: 90' \
            'replicas: 2' 'minAvailable: 1' 'clusterIP: None' 'fieldPath: spec.nodeName' \
            'value: "http://t-hosts.sbx.svc:3004"' 'procMount: Unmasked' 'kind: Secret'; do
  grep -qF "$want" "$work/out.yaml" || fail "the rendering lacks \`$want\`"
done
# With TLS: the gateway finds the hosts over https and checks them against their Service's name
# and the Secret's authority (its key is the hosts' alone), the hosts serve https, their probes
# check them by that name at 127.0.0.1, the key is root's alone and the service's copy in memory;
# the gateway serves https only with a Secret of its own.
helm template t "$chart" --namespace sbx --kube-version "$kube" --set token.value=$token \
  --set tls.existingSecret=their-tls > "$work/out.yaml"
for want in 'value: "https://t-hosts.sbx.svc:3004"' 'SANDBOX_HOST_TLS_NAME=t-hosts.sbx.svc' \
            'SANDBOX_HOST_URL=https://127.0.0.1:3004' 'secretName: their-tls' 'mode: 0400' \
            'value: /etc/sandbox-host/tls/tls.key' 'value: /etc/sandbox-host/tls/ca.crt' 'medium: Memory'; do
  grep -qF "$want" "$work/out.yaml" || fail "the TLS rendering lacks \`$want\`"
done
[ "$(grep -c 'secretName: their-tls' "$work/out.yaml")" = 2 ] || fail "the hosts' Secret is not mounted in both kinds of pod"
[ "$(grep -c 'path: tls.key' "$work/out.yaml")" = 1 ] || fail "the hosts' key reaches the gateway"
[ "$(grep -c 'value: /etc/sandbox-host/tls/tls.key' "$work/out.yaml")" = 1 ] || fail "the gateway serves with the hosts' key"
helm template t "$chart" --namespace sbx --kube-version "$kube" --set token.value=$token \
  --set tls.existingSecret=their-tls --set tls.gatewaySecret=gw-tls > "$work/out.yaml"
kubernetes-validate --strict --quiet -k "$kube" "$work/out.yaml" > "$work/v.log" 2>&1 || true
[ ! -s "$work/v.log" ] || { cat "$work/v.log" >&2; fail "the rendering with a gateway Secret is not valid Kubernetes $kube"; }
for want in 'secretName: gw-tls' 'value: /etc/sandbox-host/gateway-tls/tls.crt'; do
  grep -qF "$want" "$work/out.yaml" || fail "the gateway's TLS rendering lacks \`$want\`"
done
# The chart's refusals, each with its reason.
if out=$(helm template t "$chart" 2>&1); then fail "rendered without a token"; fi
grep -q "set token.existingSecret" <<< "$out" || fail "no reason without a token: $out"
if out=$(helm template t "$chart" --set token.value=short 2>&1); then fail "rendered with a short token"; fi
grep -q "at least 24 characters" <<< "$out" || fail "no reason for a short token: $out"
# And the validator does refuse: a field Kubernetes does not have.
sed 's/^  replicas: 2$/  replicas: 2\n  replicaz: 2/' "$work/out.yaml" > "$work/bad.yaml"
kubernetes-validate --strict --quiet -k "$kube" "$work/bad.yaml" > "$work/v.log" 2>&1 || true
grep -q "replicaz" "$work/v.log" || fail "the validator let an unknown field through"
echo "helm chart: lint, 5 renderings valid for Kubernetes $kube, refusals as expected"
