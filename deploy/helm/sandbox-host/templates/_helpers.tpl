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

{{/* The environment of TLS (both kinds of pod serve https with the Secret's pair). */}}
{{- define "sandbox-host.tlsEnv" -}}
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

{{/* The Secret's files: the key root's alone (the entrypoint gives the service a copy of its
own), the certificates readable by the probes, which run as the service's user. */}}
{{- define "sandbox-host.tlsVolume" -}}
{{- if .Values.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ .Values.tls.existingSecret }}
    items:
      - key: tls.key
        path: tls.key
        mode: 0400
      - key: tls.crt
        path: tls.crt
        mode: 0444
      - key: ca.crt
        path: ca.crt
        mode: 0444
{{- end }}
{{- end -}}

{{- define "sandbox-host.tlsMount" -}}
{{- if .Values.tls.existingSecret }}
- name: tls
  mountPath: /etc/sandbox-host/tls
  readOnly: true
{{- end }}
{{- end -}}
