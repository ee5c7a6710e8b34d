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
{{- $_ := set $labels "app.kubernetes.io/component" (ternary "dynamo-worker" "server" .Values.dynamo.enabled) }}
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

{{/*
Labels of the main (ClusterIP) Service: service.labels, then the chart's labels (which win), then a
component label that only this Service carries, so the ServiceMonitor never also selects the headless one.
*/}}
{{- define "nim-torch.serviceLabels" -}}
{{- $labels := deepCopy (.Values.service.labels | default dict) }}
{{- $labels = merge (include "nim-torch.labels" . | fromYaml) $labels }}
{{- $_ := set $labels "app.kubernetes.io/component" "api" }}
{{- toYaml $labels }}
{{- end }}

{{/*
StatefulSet only: the headless Service that gives the pods stable DNS names (the StatefulSet's serviceName).
*/}}
{{- define "nim-torch.headlessServiceName" -}}
{{- printf "%s-headless" (include "nim-torch.fullname" . | trunc 54 | trimSuffix "-") }}
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
GPUs per pod: resources.gpu, else the count already in resources.limits, else 0 for the cpu flavour, else
model.tensorParallelSize (one GPU per tensor-parallel rank), else 1.
*/}}
{{- define "nim-torch.gpuCount" -}}
{{- $res := .Values.resources }}
{{- $limits := $res.limits | default dict }}
{{- $tp := .Values.model.tensorParallelSize }}
{{- if not (kindIs "invalid" $res.gpu) }}
{{- $res.gpu | int }}
{{- else if hasKey $limits $res.gpuResourceName }}
{{- index $limits $res.gpuResourceName | int }}
{{- else if eq .Values.image.flavor "cpu" }}
{{- 0 }}
{{- else if not (kindIs "invalid" $tp) }}
{{- $tp | int }}
{{- else }}
{{- 1 }}
{{- end }}
{{- end }}

{{/*
The GPU count the user gave explicitly (resources.gpu, else resources.limits[gpuResourceName]); "" = none.
*/}}
{{- define "nim-torch.explicitGpuCount" -}}
{{- $res := .Values.resources }}
{{- $limits := $res.limits | default dict }}
{{- if not (kindIs "invalid" $res.gpu) }}
{{- $res.gpu | int }}
{{- else if hasKey $limits $res.gpuResourceName }}
{{- index $limits $res.gpuResourceName | int }}
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
Container lifecycle: `lifecycle` when set (it replaces the default entirely), else a preStop `sleep
preStopSleepSeconds` (0 = none) that keeps the pod serving while endpoints, kube-proxy and the gateway's
endpoint picker notice that it is terminating.
*/}}
{{- define "nim-torch.lifecycle" -}}
{{- if .Values.lifecycle }}
{{- toYaml .Values.lifecycle }}
{{- else if gt (int .Values.preStopSleepSeconds) 0 }}
preStop:
  exec:
    command: {{ list "sleep" (.Values.preStopSleepSeconds | int | toString) | toJson }}
{{- end }}
{{- end }}

{{/*
Seconds the preStop hook sleeps before SIGTERM: preStopSleepSeconds, or for an explicit `lifecycle` its
preStop sleep action or `sleep N` exec command (0 when it is something else).
*/}}
{{- define "nim-torch.preStopSeconds" -}}
{{- $lc := .Values.lifecycle | default dict }}
{{- if not $lc }}
{{- .Values.preStopSleepSeconds | int }}
{{- else }}
{{- $pre := $lc.preStop | default dict }}
{{- $cmd := list }}
{{- if and $pre.exec $pre.exec.command }}
{{- $cmd = $pre.exec.command }}
{{- end }}
{{- if and $pre.sleep (hasKey $pre.sleep "seconds") }}
{{- $pre.sleep.seconds | int }}
{{- else if and (eq (len $cmd) 2) (eq (index $cmd 0 | toString | base) "sleep") }}
{{- index $cmd 1 | int }}
{{- else }}
{{- 0 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
KEDA threshold: keda.prometheus.threshold, else 5 (waiting requests per replica) for `queue` and 0.8 (a
fraction of the KV cache) for `kvCache`.
*/}}
{{- define "nim-torch.kedaThreshold" -}}
{{- $p := .Values.keda.prometheus }}
{{- if and (not (kindIs "invalid" $p.threshold)) (ne ($p.threshold | toString) "") }}
{{- $p.threshold | toString }}
{{- else if eq $p.metric "kvCache" }}
{{- "0.8" }}
{{- else }}
{{- "5" }}
{{- end }}
{{- end }}

{{/*
`helm test --timeout` in minutes: each test pod may run tests.timeoutSeconds + 60 s (activeDeadlineSeconds);
at least 15.
*/}}
{{- define "nim-torch.testTimeoutMinutes" -}}
{{- max 15 (add (div (add (int .Values.tests.timeoutSeconds) 60 59) 60) 1) }}
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
{{- if and (gt (len .) 2) $root.Values.dynamo.enabled }}
{{- /* a Dynamo worker: Dynamo's status server, plain HTTP on the container port */}}
httpGet:
  path: {{ index . 2 }}
  port: http-openai
  scheme: HTTP
{{- else if eq $root.Values.tls.mode "MTLS" }}
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
{{- include "nim-torch.envFor" (list . (ternary "worker" "server" .Values.dynamo.enabled)) }}
{{- end }}

{{/*
The environment of one role: "server" (`serve`), or with dynamo.enabled "worker" (the engine: no API
settings) and "router" (the API: no engine settings), each with Dynamo's discovery settings.
*/}}
{{- define "nim-torch.envFor" -}}
{{- $root := index . 0 }}
{{- $role := index . 1 }}
{{- $api := ne $role "worker" }}
{{- $engine := ne $role "router" }}
{{- $v := $root.Values }}
{{- $m := $v.model }}
{{- $env := list }}
{{- $env = append $env (dict "name" "NIM_CACHE_PATH" "value" $m.nimCache) }}
{{- /* The image sets these under /opt/nim/.cache; they follow model.nimCache so that everything the
       Hugging Face libraries and the engines write lands on the cache volume. */}}
{{- $cache := $m.nimCache | trimSuffix "/" }}
{{- $env = append $env (dict "name" "HF_HOME" "value" (printf "%s/huggingface" $cache)) }}
{{- $env = append $env (dict "name" "XDG_CACHE_HOME" "value" (printf "%s/xdg" $cache)) }}
{{- if $api }}
{{- $env = append $env (dict "name" "NIM_SERVER_PORT" "value" ($m.openaiPort | toString)) }}
{{- $env = append $env (dict "name" "NIM_SHUTDOWN_GRACE_SECONDS" "value" ($m.shutdownGraceSeconds | toString)) }}
{{- end }}
{{- $env = append $env (dict "name" "NIM_LOG_LEVEL" "value" $m.logLevel) }}
{{- $env = append $env (dict "name" "NIM_JSONL_LOGGING" "value" (ternary "1" "0" $m.jsonLogging)) }}
{{- with $m.path }}
{{- $env = append $env (dict "name" "NIM_MODEL_NAME" "value" .) }}
{{- end }}
{{- with include "nim-torch.servedName" $root }}
{{- $env = append $env (dict "name" "NIM_SERVED_MODEL_NAME" "value" .) }}
{{- end }}
{{- if $engine }}
{{- with $m.profile }}
{{- $env = append $env (dict "name" "NIM_MODEL_PROFILE" "value" .) }}
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
{{- if $m.loraSource }}
{{- $env = append $env (dict "name" "NIM_PEFT_SOURCE" "value" $m.loraSource) }}
{{- range $key, $name := dict "refreshInterval" "NIM_PEFT_REFRESH_INTERVAL" "maxRank" "NIM_MAX_LORA_RANK" "maxGpuLoras" "NIM_MAX_GPU_LORAS" "maxCpuLoras" "NIM_MAX_CPU_LORAS" }}
{{- $value := index $m.lora $key }}
{{- if not (kindIs "invalid" $value) }}
{{- $env = append $env (dict "name" $name "value" (toString $value)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if $m.hfHubOffline }}
{{- $env = append $env (dict "name" "HF_HUB_OFFLINE" "value" "1") }}
{{- end }}
{{- with include "nim-torch.hfTokenSecretName" $root }}
{{- $keyRef := dict "name" . "key" $m.hfTokenSecret.key }}
{{- if not $m.hfTokenSecret.name }}
{{- /* From the nim-llm alias: that Secret usually holds NGC_API_KEY only, and a missing key must not
       stop the container (CreateContainerConfigError); HF_TOKEN is then simply unset. */}}
{{- $_ := set $keyRef "optional" true }}
{{- end }}
{{- $env = append $env (dict "name" "HF_TOKEN" "valueFrom" (dict "secretKeyRef" $keyRef)) }}
{{- end }}
{{- if $api }}
{{- with $v.auth.apiKeySecret.name }}
{{- $ref := dict "secretKeyRef" (dict "name" . "key" $v.auth.apiKeySecret.key) }}
{{- $env = append $env (dict "name" "NIM_API_KEY" "valueFrom" $ref) }}
{{- end }}
{{- if include "nim-torch.tlsEnabled" $root }}
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
{{- $svc := $v.tracing.serviceName | default (include "nim-torch.fullname" $root) }}
{{- $env = append $env (dict "name" "OTEL_SERVICE_NAME" "value" $svc) }}
{{- end }}
{{- end }}
{{- if ne $role "server" }}
{{- $d := $v.dynamo }}
{{- $env = append $env (dict "name" "NIM_DYNAMO_NAMESPACE" "value" (include "nim-torch.dynamoNamespace" $root)) }}
{{- $env = append $env (dict "name" "NIM_DYNAMO_DISCOVERY" "value" "etcd") }}
{{- $env = append $env (dict "name" "ETCD_ENDPOINTS" "value" $d.etcdEndpoints) }}
{{- if eq $role "worker" }}
{{- /* Dynamo's status server (/live, /health, /metrics) on the container port: the worker's probes */}}
{{- $env = append $env (dict "name" "DYN_SYSTEM_PORT" "value" ($m.openaiPort | toString)) }}
{{- $env = append $env (dict "name" "DYN_SYSTEM_HOST" "value" "0.0.0.0") }}
{{- else }}
{{- $env = append $env (dict "name" "NIM_DYNAMO_ROUTER_MODE" "value" $d.router.mode) }}
{{- $env = append $env (dict "name" "NIM_DYNAMO_ROUTER_TRACK_ACTIVE_BLOCKS" "value" (ternary "1" "0" $d.router.trackActiveBlocks)) }}
{{- end }}
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
The API name of the model: model.name (NVIDIA's nim-llm meaning), else its deprecated spelling
model.servedName; "" = the server's default.
*/}}
{{- define "nim-torch.servedName" -}}
{{- .Values.model.name | default .Values.model.servedName }}
{{- end }}

{{/*
The main Service's name: service.name (nim-llm's override), else the full name.
*/}}
{{- define "nim-torch.serviceName" -}}
{{- .Values.service.name | default (include "nim-torch.fullname" .) }}
{{- end }}

{{/*
Whether the model to load is named anywhere: model.path, or NIM_MODEL_NAME (the way NVIDIA's nim-llm
chart names it for the multi-LLM NIM) or NIM_MODEL_PATH (NIM 2.x's model-free image) in env/extraEnv.
*/}}
{{- define "nim-torch.modelToLoad" -}}
{{- $named := .Values.model.path }}
{{- range concat (.Values.env | default list) (.Values.extraEnv | default list) }}
{{- if has .name (list "NIM_MODEL_NAME" "NIM_MODEL_PATH") }}{{ $named = "env" }}{{ end }}
{{- end }}
{{- $named }}
{{- end }}

{{/*
One chart-created cache claim (<fullname>-cache) mounted by every replica: a Deployment's, or, with
nim-llm's persistence.accessMode ReadWriteMany, a StatefulSet's (nim-llm's meaning: a central RWX
claim instead of one claim per replica). "" = none (an existing claim, per-replica claims, no
persistence).
*/}}
{{- define "nim-torch.sharedCacheClaim" -}}
{{- $p := .Values.persistence }}
{{- if and $p.enabled (not $p.existingClaim) }}
{{- if or (eq .Values.workload.kind "Deployment") (eq ($p.accessMode | default "") "ReadWriteMany") }}true{{ end }}
{{- end }}
{{- end }}

{{/*
Values written for NVIDIA's nim-llm chart, mapped onto this chart's keys with nim-llm's meaning.
Every template includes it first (it is idempotent), so all of them see the same values. A nim-llm
key this chart cannot honour stops the install here with one line saying why.
*/}}
{{- define "nim-torch.nimLlmCompat" -}}
{{- $v := .Values }}
{{- $m := $v.model }}
{{- if $m.legacyCompat }}
{{- fail "model.legacyCompat: pre-1.0 NIM containers (nemollm_inference_ms and its ports) are not supported by this chart; leave it false" }}
{{- end }}
{{- if $m.ngcAPIKey }}
{{- fail "model.ngcAPIKey: this chart takes no keys as literal values and its server does not download from NGC; put HF_TOKEN in a Secret and name it in model.hfTokenSecret.name (or model.ngcAPISecret)" }}
{{- end }}
{{- if $v.multiNode.enabled }}
{{- fail "multiNode.enabled: multi-node deployments (LeaderWorkerSet, MPIJob) are not supported by this chart; tensor parallelism runs inside one pod (model.tensorParallelSize)" }}
{{- end }}
{{- if and (kindIs "map" $v.initContainers) $v.initContainers.ngcInit }}
{{- fail "initContainers.ngcInit: the NGC CLI model puller is not supported; the server downloads the model itself (to pre-fill the cache, run `download-to-cache` in initContainers.extraInit)" }}
{{- end }}
{{- range concat ($v.env | default list) ($v.extraEnv | default list) }}
{{- if and (eq .name "NIM_MODEL_PATH") $m.path (ne (.value | default "" | trimPrefix "hf://") $m.path) }}
{{- fail (printf "model.path (%s) and env NIM_MODEL_PATH (%s) name the model twice: set one of them" $m.path (.value | default "")) }}
{{- end }}
{{- end }}
{{- if and $v.nfs.enabled (not $v.persistence.enabled) (not $v.hostPath.enabled) (or (not $v.nfs.server) (not $v.nfs.path)) }}
{{- fail "nfs.enabled needs nfs.server and nfs.path (the export the cache lives on)" }}
{{- end }}
{{- if and $m.name $m.servedName (ne $m.name $m.servedName) }}
{{- fail (printf "model.name (%s) and model.servedName (%s, its deprecated spelling) disagree: set model.name only" $m.name $m.servedName) }}
{{- end }}
{{- if not (kindIs "invalid" $v.statefulSet.enabled) }}
{{- $_ := set $v.workload "kind" (ternary "StatefulSet" "Deployment" $v.statefulSet.enabled) }}
{{- end }}
{{- if not (kindIs "invalid" $v.replicaCount) }}
{{- $_ := set $v.workload "replicas" $v.replicaCount }}
{{- end }}
{{- with $v.persistence.accessMode }}
{{- $_ := set $v.persistence "accessModes" (list .) }}
{{- end }}
{{- with $v.customCommand }}
{{- $_ := set $v "command" . }}
{{- end }}
{{- with $v.customArgs }}
{{- $_ := set $v "args" . }}
{{- end }}
{{- with $v.containerSecurityContext }}
{{- $_ := set $v "securityContext" . }}
{{- end }}
{{- with $m.labels }}
{{- $_ := set $v "podLabels" (merge (deepCopy ($v.podLabels | default dict)) .) }}
{{- end }}
{{- if kindIs "map" $v.initContainers }}
{{- $_ := set $v "initContainers" ($v.initContainers.extraInit | default list) }}
{{- end }}
{{- range $key := list "extraVolumes" "extraVolumeMounts" }}
{{- $given := index $v $key }}
{{- if kindIs "map" $given }}
{{- $items := list }}
{{- range $name, $spec := $given }}
{{- $items = append $items (merge (dict "name" $name) (deepCopy $spec)) }}
{{- end }}
{{- $_ := set $v $key $items }}
{{- end }}
{{- end }}
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
{{- $p := $v.keda.prometheus }}
{{- if not $p.serverAddress }}
{{- fail "keda.enabled needs keda.prometheus.serverAddress (the Prometheus URL KEDA queries), e.g. http://prometheus-operated.monitoring.svc:9090" }}
{{- end }}
{{- if gt (int $v.keda.minReplicaCount) (int $v.keda.maxReplicaCount) }}
{{- fail (printf "keda.minReplicaCount (%v) must not exceed keda.maxReplicaCount (%v)" $v.keda.minReplicaCount $v.keda.maxReplicaCount) }}
{{- end }}
{{- if not $p.query }}
{{- if not $v.metrics.serviceMonitor.enabled }}
{{- fail (printf "keda.enabled with the built-in query (keda.prometheus.metric=%s) needs metrics.serviceMonitor.enabled=true: the query selects the release's series by the `service` label that the ServiceMonitor's scrape adds, so without it KEDA finds no data. Enable metrics.serviceMonitor, or give your own keda.prometheus.query." $p.metric) }}
{{- end }}
{{- $threshold := include "nim-torch.kedaThreshold" . }}
{{- if and (eq $p.metric "kvCache") (gt (float64 $threshold) 1.0) }}
{{- fail (printf "keda.prometheus.threshold (%s) is above 1, but keda.prometheus.metric=kvCache scales on vllm:kv_cache_usage_perc, a fraction from 0 to 1: use e.g. 0.8 (or leave it null for 0.8)" $threshold) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (include "nim-torch.tlsEnabled" .) (not $v.tls.secretName) }}
{{- fail (printf "tls.mode=%s needs tls.secretName: an existing kubernetes.io/tls Secret (tls.crt, tls.key%s)" $v.tls.mode (ternary ", ca.crt" "" (eq $v.tls.mode "MTLS"))) }}
{{- end }}
{{- $preStop := include "nim-torch.preStopSeconds" . | int }}
{{- $needed := add $preStop (int $v.model.shutdownGraceSeconds) 10 }}
{{- if lt (int $v.terminationGracePeriodSeconds) $needed }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be at least %v: the preStop hook (%v s) + model.shutdownGraceSeconds (%v) + 10 s for the server to exit, all within the grace period, or Kubernetes kills the server before in-flight requests finish" $v.terminationGracePeriodSeconds $needed $preStop $v.model.shutdownGraceSeconds) }}
{{- end }}
{{- if and $v.pdb.enabled (kindIs "invalid" $v.pdb.minAvailable) (kindIs "invalid" $v.pdb.maxUnavailable) }}
{{- fail "pdb.enabled needs pdb.minAvailable or pdb.maxUnavailable" }}
{{- end }}
{{- if and $v.persistence.enabled (not $v.persistence.existingClaim) (not $v.persistence.accessModes) }}
{{- fail "persistence.accessModes must not be empty when persistence.enabled creates a claim" }}
{{- end }}
{{- if and (eq $v.workload.kind "Deployment") $v.persistence.enabled (not $v.persistence.existingClaim) }}
{{- $modes := $v.persistence.accessModes }}
{{- $shared := or (has "ReadWriteMany" $modes) (has "ReadOnlyMany" $modes) }}
{{- $scaled := or $v.autoscaling.enabled $v.keda.enabled }}
{{- if and (not $shared) (or $scaled (gt (int $v.workload.replicas) 1)) }}
{{- fail (printf "workload.kind=Deployment mounts one chart-created claim (%s-cache) in every replica, but persistence.accessModes %v attaches it to a single node: with workload.replicas > 1, autoscaling.enabled or keda.enabled, pods on other nodes hang on Multi-Attach errors. Use persistence.accessModes [ReadWriteMany], a persistence.existingClaim, or workload.kind=StatefulSet (one claim per replica)." (include "nim-torch.fullname" .) $modes) }}
{{- end }}
{{- end }}
{{- $explicitGpus := include "nim-torch.explicitGpuCount" . }}
{{- $tp := $v.model.tensorParallelSize }}
{{- /* 0 GPUs = the CPU engine, a single rank */}}
{{- if and (not (kindIs "invalid" $tp)) $explicitGpus (gt (int $tp) (max 1 (int $explicitGpus))) }}
{{- fail (printf "model.tensorParallelSize (%v) needs one GPU per rank, but the pod gets %v (resources.gpu or resources.limits[%s]): raise the GPU count, or leave resources.gpu null to request %v" $tp $explicitGpus $v.resources.gpuResourceName $tp) }}
{{- end }}
{{- $lora := $v.model.lora }}
{{- if and (not $v.model.loraSource) (or (not (kindIs "invalid" $lora.refreshInterval)) (not (kindIs "invalid" $lora.maxRank)) (not (kindIs "invalid" $lora.maxGpuLoras)) (not (kindIs "invalid" $lora.maxCpuLoras))) }}
{{- fail "model.lora settings need model.loraSource (NIM_PEFT_SOURCE): without adapters they govern nothing, and the service refuses them at start." }}
{{- end }}
{{- if and $v.model.loraSource (not (kindIs "invalid" $lora.maxGpuLoras)) (not (kindIs "invalid" $lora.maxCpuLoras)) (lt (int $lora.maxCpuLoras) (int $lora.maxGpuLoras)) }}
{{- fail (printf "model.lora.maxCpuLoras (%v) is below model.lora.maxGpuLoras (%v): every adapter on the device is also kept in host memory, and the service refuses this at start." $lora.maxCpuLoras $lora.maxGpuLoras) }}
{{- end }}
{{- if $v.dynamo.enabled }}
{{- if not $v.dynamo.etcdEndpoints }}
{{- fail "dynamo.enabled needs dynamo.etcdEndpoints (ETCD_ENDPOINTS), the etcd through which Dynamo's workers and router find each other, e.g. http://etcd.dynamo.svc:2379" }}
{{- end }}
{{- if or $v.autoscaling.enabled $v.keda.enabled }}
{{- fail "dynamo.enabled with autoscaling or keda: they scale on the API's vLLM series, which Dynamo workers do not serve; scale workload.replicas (or use Dynamo's planner)" }}
{{- end }}
{{- if $v.inferencePool.enabled }}
{{- fail "dynamo.enabled with inferencePool.enabled: Dynamo's KV router chooses the worker, so a gateway's endpoint picker has nothing to choose; enable one of them" }}
{{- end }}
{{- end }}
{{- if and $v.metrics.serviceMonitor.enabled (eq $v.tls.mode "MTLS") (not $v.metrics.serviceMonitor.tlsConfig) }}
{{- fail "metrics.serviceMonitor.enabled with tls.mode=MTLS needs metrics.serviceMonitor.tlsConfig with a client certificate config (ca, cert and keySecret, e.g. from the tls.clientSecretName Secret): the server refuses scrapes without a client certificate." }}
{{- end }}
{{- end }}

{{/*
Dynamo: the namespace workers and router share, and the router pods' selector labels (a name of their
own, so the workload's selector, which must never change, does not match them).
*/}}
{{- define "nim-torch.dynamoNamespace" -}}
{{- .Values.dynamo.namespace | default (include "nim-torch.fullname" .) }}
{{- end }}

{{- define "nim-torch.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-router" (include "nim-torch.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "nim-torch.routerName" -}}
{{- printf "%s-router" (include "nim-torch.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}
