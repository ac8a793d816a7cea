{{- define "sandbox-host.name" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "sandbox-host.labels" -}}
app.kubernetes.io/name: sandbox-host
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "sandbox-host.tokenSecret" -}}
{{- if .Values.token.existingSecret -}}
{{- .Values.token.existingSecret -}}
{{- else -}}
{{- printf "%s-token" (include "sandbox-host.name" .) -}}
{{- end -}}
{{- end -}}

{{- define "sandbox-host.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{/* The health command of both kinds of pod: `sandbox-host health` as the service's user. */}}
{{- define "sandbox-host.healthProbe" -}}
exec:
  command:
    - setpriv
    - --reuid
    - sandbox-host
    - --regid
    - sandbox-host
    - --clear-groups
    - --
    - env
    {{- if .tls }}
    - SANDBOX_HOST_URL=https://127.0.0.1:{{ .port }}
    - SANDBOX_HOST_TLS_NAME={{ .tlsName }}
    - SANDBOX_HOST_CA_FILE=/etc/sandbox-host/tls/ca.crt
    {{- else }}
    - SANDBOX_HOST_URL=http://127.0.0.1:{{ .port }}
    {{- end }}
    - /opt/sandbox-host/bin/sandbox-host
    - health
{{- end -}}

{{/* The name the hosts' certificates are issued for: their headless Service's. */}}
{{- define "sandbox-host.hostsName" -}}
{{- printf "%s-hosts.%s.svc" (include "sandbox-host.name" .) .Release.Namespace -}}
{{- end -}}

{{/* The hosts' TLS: they serve https with the Secret's pair (its key root's alone: the
entrypoint gives the service's user a copy of its own, in memory), and their probes check it
against its ca.crt. */}}
{{- define "sandbox-host.hostTlsEnv" -}}
{{- if .Values.tls.existingSecret }}
- name: SANDBOX_HOST_TLS_CERT
  value: /etc/sandbox-host/tls/tls.crt
- name: SANDBOX_HOST_TLS_KEY
  value: /etc/sandbox-host/tls/tls.key
- name: SANDBOX_HOST_CA_FILE
  value: /etc/sandbox-host/tls/ca.crt
- name: SANDBOX_HOST_TLS_NAME
  value: {{ include "sandbox-host.hostsName" . | quote }}
{{- end }}
{{- end -}}

{{/* The gateway's TLS: it checks the hosts against the hosts' Secret's ca.crt (their key is
not mounted in it), and serves https only with a Secret of its own (a host runs guests' code:
its key must not be able to pose as the gateway). */}}
{{- define "sandbox-host.gatewayTlsEnv" -}}
{{- if .Values.tls.existingSecret }}
- name: SANDBOX_HOST_CA_FILE
  value: /etc/sandbox-host/tls/ca.crt
- name: SANDBOX_HOST_TLS_NAME
  value: {{ include "sandbox-host.hostsName" . | quote }}
{{- end }}
{{- if .Values.tls.gatewaySecret }}
- name: SANDBOX_HOST_TLS_CERT
  value: /etc/sandbox-host/gateway-tls/tls.crt
- name: SANDBOX_HOST_TLS_KEY
  value: /etc/sandbox-host/gateway-tls/tls.key
{{- end }}
{{- end -}}

{{/* A Secret's files: the key root's alone, the certificates readable by the probes, which run
as the service's user. `keys` false: the authority alone. */}}
{{- define "sandbox-host.tlsVolume" -}}
- name: {{ .name }}
  secret:
    secretName: {{ .secret }}
    items:
      {{- if .keys }}
      - key: tls.key
        path: tls.key
        mode: 0400
      - key: tls.crt
        path: tls.crt
        mode: 0444
      {{- end }}
      - key: ca.crt
        path: ca.crt
        mode: 0444
{{- end -}}
