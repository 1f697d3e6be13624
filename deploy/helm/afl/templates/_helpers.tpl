{{/* Names, labels and the checks every template relies on. */}}

{{- define "afl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "afl.component" -}}
{{- $c := .Values.component -}}
{{- if not (has $c (list "coordinator" "site" "decryptor")) -}}
{{- fail (printf "component must be coordinator, site or decryptor (got %q)" $c) -}}
{{- end -}}
{{- $c -}}
{{- end -}}

{{- define "afl.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ include "afl.component" . }}
{{- end -}}

{{- define "afl.labels" -}}
{{ include "afl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "afl.image" -}}
{{- if not .Values.image.repository -}}
{{- fail "image.repository is required (an image of deploy/Dockerfile.server or deploy/Dockerfile.client)" -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}
{{- end -}}

{{/* The kit's file names inside /etc/afl/kit. */}}
{{- define "afl.configFile" -}}
{{- if eq (include "afl.component" .) "coordinator" -}}server.toml{{- else -}}client.toml{{- end -}}
{{- end -}}

{{- define "afl.leaf" -}}
{{- if eq (include "afl.component" .) "coordinator" -}}server{{- else -}}site{{- end -}}
{{- end -}}

{{- define "afl.tlsSecret" -}}
{{- if .Values.tls.certManager.enabled -}}
{{- if ne (include "afl.component" .) "coordinator" -}}
{{- fail "tls.certManager is for the coordinator only: a site's key is made at the site (afl-client init), use tls.existingSecret" -}}
{{- end -}}
{{- printf "%s-tls" (include "afl.fullname" .) -}}
{{- else if .Values.tls.existingSecret -}}
{{- .Values.tls.existingSecret -}}
{{- else -}}
{{- fail "tls.existingSecret is required (a Secret with tls.crt, tls.key and ca.crt from the party's kit), or tls.certManager.enabled for the coordinator" -}}
{{- end -}}
{{- end -}}

{{- define "afl.claimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-state" (include "afl.fullname" .)) -}}
{{- end -}}

{{- define "afl.podSecurity" -}}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
