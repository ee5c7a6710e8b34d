{{/*
Chart name, truncated to 63 characters (DNS label).
*/}}
{{- define "nim-torch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: <release>-<chart>, or the release name when it already contains the chart name.
*/}}
{{- define "nim-torch.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "nim-torch.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels shared by every object.
*/}}
{{- define "nim-torch.commonLabels" -}}
helm.sh/chart: {{ include "nim-torch.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: {{ include "nim-torch.name" . }}
{{- end }}

{{/*
Selector labels: immutable on a StatefulSet/Deployment, so never add to them.
*/}}
{{- define "nim-torch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nim-torch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "nim-torch.labels" -}}
{{ include "nim-torch.selectorLabels" . }}
{{ include "nim-torch.commonLabels" . }}
{{- end }}

{{/*
Pod template labels as YAML: podLabels, then the chart's labels (which win), then the inference engine
type label the Gateway API Inference Extension's endpoint picker reads.
*/}}
{{- define "nim-torch.podLabels" -}}
{{- $labels := deepCopy (.Values.podLabels | default dict) }}
{{- $labels = merge (include "nim-torch.labels" . | fromYaml) $labels }}
{{- $_ := set $labels "app.kubernetes.io/component" "server" }}
{{- with .Values.inferencePool.engineType }}
{{- $_ := set $labels "inference.networking.k8s.io/engine-type" . }}
{{- end }}
{{- toYaml $labels }}
{{- end }}

{{/*
InferencePool selector: the workload's selector labels plus the engine-type label (all carried by the pods).
*/}}
{{- define "nim-torch.inferencePoolSelector" -}}
{{- $labels := include "nim-torch.selectorLabels" . | fromYaml }}
{{- with .Values.inferencePool.engineType }}
{{- $_ := set $labels "inference.networking.k8s.io/engine-type" . }}
{{- end }}
{{- toYaml $labels }}
{{- end }}

{{/*
Labels of the helm test pods: deliberately NOT matching the workload selector (no app.kubernetes.io/name).
*/}}
{{- define "nim-torch.testSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: helm-test
{{- end }}

{{- define "nim-torch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "nim-torch.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image reference: repository:<tag or appVersion-flavor>[@digest].
*/}}
{{- define "nim-torch.image" -}}
{{- $img := .image }}
{{- $tag := $img.tag | default (printf "%s-%s" .root.Chart.AppVersion .root.Values.image.flavor) }}
{{- if $img.digest }}
{{- printf "%s:%s@%s" $img.repository $tag $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository $tag }}
{{- end }}
{{- end }}

{{/*
GPUs per pod: resources.gpu, else the count already in resources.limits, else 1 (gpu flavour) / 0 (cpu).
*/}}
{{- define "nim-torch.gpuCount" -}}
{{- $res := .Values.resources }}
{{- $limits := $res.limits | default dict }}
{{- if not (kindIs "invalid" $res.gpu) }}
{{- $res.gpu | int }}
{{- else if hasKey $limits $res.gpuResourceName }}
{{- index $limits $res.gpuResourceName | int }}
{{- else if eq .Values.image.flavor "cpu" }}
{{- 0 }}
{{- else }}
{{- 1 }}
{{- end }}
{{- end }}

{{/*
Container resources with the GPU count in both limits and requests (or no GPU key at all for 0).
*/}}
{{- define "nim-torch.resources" -}}
{{- $gpus := include "nim-torch.gpuCount" . | int }}
{{- $gpuName := .Values.resources.gpuResourceName }}
{{- $limits := deepCopy (.Values.resources.limits | default dict) }}
{{- $requests := deepCopy (.Values.resources.requests | default dict) }}
{{- if gt $gpus 0 }}
{{- $_ := set $limits $gpuName $gpus }}
{{- $_ := set $requests $gpuName $gpus }}
{{- else }}
{{- $_ := unset $limits $gpuName }}
{{- $_ := unset $requests $gpuName }}
{{- end }}
{{- with $limits }}
limits:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $requests }}
requests:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "nim-torch.tlsEnabled" -}}
{{- if ne .Values.tls.mode "DISABLED" }}true{{ end }}
{{- end }}

{{- define "nim-torch.scheme" -}}
{{- if include "nim-torch.tlsEnabled" . }}https{{ else }}http{{ end }}
{{- end }}

{{- define "nim-torch.clientCertDir" -}}
{{- if .Values.tls.clientSecretName }}/etc/nim/tls-client{{ else }}{{ .Values.tls.mountPath }}{{ end }}
{{- end }}

{{/*
HF_TOKEN Secret name: model.hfTokenSecret.name, else the nim-llm alias model.ngcAPISecret.
*/}}
{{- define "nim-torch.hfTokenSecretName" -}}
{{- .Values.model.hfTokenSecret.name | default .Values.model.ngcAPISecret }}
{{- end }}

{{/*
Python one-liner an MTLS exec probe runs inside the container: GET a path with the client certificate;
exit status 0 only for a 2xx answer.
*/}}
{{- define "nim-torch.mtlsProbeCommand" -}}
{{- $root := index . 0 }}
{{- $path := index . 1 }}
{{- $dir := include "nim-torch.clientCertDir" $root }}
{{- $code := printf "import ssl,urllib.request as u;c=ssl._create_unverified_context();c.load_cert_chain('%s/tls.crt','%s/tls.key');u.urlopen('https://127.0.0.1:%v%s',context=c,timeout=4)" $dir $dir $root.Values.model.openaiPort $path }}
{{- list $root.Values.tests.python "-c" $code | toJson }}
{{- end }}

{{/*
One probe from its values object: httpGet (HTTP/HTTPS) or, for MTLS, exec.
*/}}
{{- define "nim-torch.probe" -}}
{{- $root := index . 0 }}
{{- $probe := index . 1 }}
{{- if eq $root.Values.tls.mode "MTLS" }}
exec:
  command: {{ include "nim-torch.mtlsProbeCommand" (list $root $probe.path) }}
{{- else }}
httpGet:
  path: {{ $probe.path }}
  port: http-openai
  scheme: {{ include "nim-torch.scheme" $root | upper }}
{{- end }}
initialDelaySeconds: {{ $probe.initialDelaySeconds }}
periodSeconds: {{ $probe.periodSeconds }}
timeoutSeconds: {{ $probe.timeoutSeconds }}
successThreshold: {{ $probe.successThreshold }}
failureThreshold: {{ $probe.failureThreshold }}
{{- end }}

{{/*
The container's environment: what the chart derives from values, then env and extraEnv. A later entry
with the same name replaces an earlier one, so the list has no duplicates (server-side apply rejects them).
*/}}
{{- define "nim-torch.env" -}}
{{- $v := .Values }}
{{- $m := $v.model }}
{{- $env := list }}
{{- $env = append $env (dict "name" "NIM_CACHE_PATH" "value" $m.nimCache) }}
{{- $env = append $env (dict "name" "NIM_SERVER_PORT" "value" ($m.openaiPort | toString)) }}
{{- $env = append $env (dict "name" "NIM_SHUTDOWN_GRACE_SECONDS" "value" ($m.shutdownGraceSeconds | toString)) }}
{{- $env = append $env (dict "name" "NIM_LOG_LEVEL" "value" $m.logLevel) }}
{{- $env = append $env (dict "name" "NIM_JSONL_LOGGING" "value" (ternary "1" "0" $m.jsonLogging)) }}
{{- with $m.name }}
{{- $env = append $env (dict "name" "NIM_MODEL_NAME" "value" .) }}
{{- end }}
{{- with $m.profile }}
{{- $env = append $env (dict "name" "NIM_MODEL_PROFILE" "value" .) }}
{{- end }}
{{- with $m.servedName }}
{{- $env = append $env (dict "name" "NIM_SERVED_MODEL_NAME" "value" .) }}
{{- end }}
{{- if not (kindIs "invalid" $m.maxModelLen) }}
{{- $env = append $env (dict "name" "NIM_MAX_MODEL_LEN" "value" ($m.maxModelLen | int | toString)) }}
{{- end }}
{{- if not (kindIs "invalid" $m.tensorParallelSize) }}
{{- $env = append $env (dict "name" "NIM_TENSOR_PARALLEL_SIZE" "value" ($m.tensorParallelSize | int | toString)) }}
{{- end }}
{{- if not (kindIs "invalid" $m.kvCachePercent) }}
{{- $env = append $env (dict "name" "NIM_KV_CACHE_PERCENT" "value" ($m.kvCachePercent | toString)) }}
{{- end }}
{{- if not (kindIs "invalid" $m.enableKvCacheReuse) }}
{{- $env = append $env (dict "name" "NIM_ENABLE_KV_CACHE_REUSE" "value" (ternary "1" "0" $m.enableKvCacheReuse)) }}
{{- end }}
{{- with $m.loraSource }}
{{- $env = append $env (dict "name" "NIM_PEFT_SOURCE" "value" .) }}
{{- end }}
{{- if $m.hfHubOffline }}
{{- $env = append $env (dict "name" "HF_HUB_OFFLINE" "value" "1") }}
{{- end }}
{{- with include "nim-torch.hfTokenSecretName" . }}
{{- $ref := dict "secretKeyRef" (dict "name" . "key" $m.hfTokenSecret.key) }}
{{- $env = append $env (dict "name" "HF_TOKEN" "valueFrom" $ref) }}
{{- end }}
{{- with $v.auth.apiKeySecret.name }}
{{- $ref := dict "secretKeyRef" (dict "name" . "key" $v.auth.apiKeySecret.key) }}
{{- $env = append $env (dict "name" "NIM_API_KEY" "valueFrom" $ref) }}
{{- end }}
{{- if include "nim-torch.tlsEnabled" . }}
{{- $dir := $v.tls.mountPath }}
{{- $env = append $env (dict "name" "NIM_SSL_MODE" "value" $v.tls.mode) }}
{{- $env = append $env (dict "name" "NIM_SSL_KEY_PATH" "value" (printf "%s/tls.key" $dir)) }}
{{- $env = append $env (dict "name" "NIM_SSL_CERTS_PATH" "value" (printf "%s/tls.crt" $dir)) }}
{{- if eq $v.tls.mode "MTLS" }}
{{- $env = append $env (dict "name" "NIM_SSL_CA_CERTS_PATH" "value" (printf "%s/ca.crt" $dir)) }}
{{- end }}
{{- end }}
{{- with $v.tracing.otlpEndpoint }}
{{- $env = append $env (dict "name" "OTEL_EXPORTER_OTLP_ENDPOINT" "value" .) }}
{{- $svc := $v.tracing.serviceName | default (include "nim-torch.fullname" $) }}
{{- $env = append $env (dict "name" "OTEL_SERVICE_NAME" "value" $svc) }}
{{- end }}
{{- $all := concat $env ($v.env | default list) ($v.extraEnv | default list) }}
{{- $out := list }}
{{- range $i, $e := $all }}
{{- $later := false }}
{{- range $j, $f := $all }}
{{- if and (gt $j $i) (eq $f.name $e.name) }}
{{- $later = true }}
{{- end }}
{{- end }}
{{- if not $later }}
{{- $out = append $out $e }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/*
Checks that JSON schema cannot express; rendered from the workload so every install runs them.
*/}}
{{- define "nim-torch.validate" -}}
{{- $v := .Values }}
{{- if and $v.autoscaling.enabled $v.keda.enabled }}
{{- fail "autoscaling.enabled and keda.enabled are mutually exclusive: both would create an HPA for the same workload. Enable one of them." }}
{{- end }}
{{- if and $v.autoscaling.enabled (gt (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas)) }}
{{- fail (printf "autoscaling.minReplicas (%v) must not exceed autoscaling.maxReplicas (%v)" $v.autoscaling.minReplicas $v.autoscaling.maxReplicas) }}
{{- end }}
{{- if $v.keda.enabled }}
{{- if not $v.keda.prometheus.serverAddress }}
{{- fail "keda.enabled needs keda.prometheus.serverAddress (the Prometheus URL KEDA queries), e.g. http://prometheus-operated.monitoring.svc:9090" }}
{{- end }}
{{- if gt (int $v.keda.minReplicaCount) (int $v.keda.maxReplicaCount) }}
{{- fail (printf "keda.minReplicaCount (%v) must not exceed keda.maxReplicaCount (%v)" $v.keda.minReplicaCount $v.keda.maxReplicaCount) }}
{{- end }}
{{- end }}
{{- if and (include "nim-torch.tlsEnabled" .) (not $v.tls.secretName) }}
{{- fail (printf "tls.mode=%s needs tls.secretName: an existing kubernetes.io/tls Secret (tls.crt, tls.key%s)" $v.tls.mode (ternary ", ca.crt" "" (eq $v.tls.mode "MTLS"))) }}
{{- end }}
{{- if le (int $v.terminationGracePeriodSeconds) (int $v.model.shutdownGraceSeconds) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed model.shutdownGraceSeconds (%v), or Kubernetes kills the server before in-flight requests finish" $v.terminationGracePeriodSeconds $v.model.shutdownGraceSeconds) }}
{{- end }}
{{- if and $v.pdb.enabled (kindIs "invalid" $v.pdb.minAvailable) (kindIs "invalid" $v.pdb.maxUnavailable) }}
{{- fail "pdb.enabled needs pdb.minAvailable or pdb.maxUnavailable" }}
{{- end }}
{{- if and $v.persistence.enabled (not $v.persistence.existingClaim) (not $v.persistence.accessModes) }}
{{- fail "persistence.accessModes must not be empty when persistence.enabled creates a claim" }}
{{- end }}
{{- end }}
