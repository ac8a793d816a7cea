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
    - SANDBOX_HOST_URL=http://127.0.0.1:{{ .port }}
    - /opt/sandbox-host/bin/sandbox-host
    - health
{{- end -}}
