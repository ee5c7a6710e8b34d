{{/*
Pod template shared by the StatefulSet and the Deployment.
*/}}
{{- define "nim-torch.podTemplate" -}}
{{- $v := .Values }}
{{- $tls := include "nim-torch.tlsEnabled" . }}
metadata:
  labels:
    {{- include "nim-torch.podLabels" . | nindent 4 }}
  {{- with $v.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "nim-torch.serviceAccountName" . }}
  automountServiceAccountToken: {{ $v.serviceAccount.automountServiceAccountToken }}
  # No <SERVICE>_* variables: a Service named nim... would inject NIM_SERVICE_HOST, NIM_PORT, ...
  enableServiceLinks: false
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $v.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- with $v.initContainers }}
  initContainers:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: nim
      image: {{ include "nim-torch.image" (dict "image" $v.image "root" .) | quote }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- with $v.command }}
      command:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $v.args }}
      args:
        {{- toYaml $v.args | nindent 8 }}
      {{- else if $v.dynamo.enabled }}
      args: ["dynamo-worker"]
      {{- end }}
      ports:
        - name: http-openai
          containerPort: {{ $v.model.openaiPort }}
          protocol: TCP
      env:
        {{- include "nim-torch.env" . | nindent 8 }}
      {{- with $v.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "nim-torch.resources" .) }}
      resources:
        {{- . | trim | nindent 8 }}
      {{- else }}
      resources: {}
      {{- end }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      {{- if $v.startupProbe.enabled }}
      startupProbe:
        {{- include "nim-torch.probe" (list . $v.startupProbe "/health") | trim | nindent 8 }}
      {{- end }}
      {{- if $v.livenessProbe.enabled }}
      livenessProbe:
        {{- include "nim-torch.probe" (list . $v.livenessProbe "/live") | trim | nindent 8 }}
      {{- end }}
      {{- if $v.readinessProbe.enabled }}
      readinessProbe:
        {{- include "nim-torch.probe" (list . $v.readinessProbe "/health") | trim | nindent 8 }}
      {{- end }}
      {{- with (include "nim-torch.lifecycle" .) }}
      lifecycle:
        {{- . | trim | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: nim-cache
          mountPath: {{ $v.model.nimCache }}
        - name: tmp
          mountPath: /tmp
        {{- if $v.shm.enabled }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
        {{- if $tls }}
        - name: tls
          mountPath: {{ $v.tls.mountPath }}
          readOnly: true
        {{- if and (eq $v.tls.mode "MTLS") $v.tls.clientSecretName }}
        - name: tls-client
          mountPath: /etc/nim/tls-client
          readOnly: true
        {{- end }}
        {{- end }}
        {{- with $v.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    {{- if and $v.persistence.enabled $v.persistence.existingClaim }}
    - name: nim-cache
      persistentVolumeClaim:
        claimName: {{ $v.persistence.existingClaim }}
    {{- else if include "nim-torch.sharedCacheClaim" . }}
    - name: nim-cache
      persistentVolumeClaim:
        claimName: {{ include "nim-torch.fullname" . }}-cache
    {{- else if and (not $v.persistence.enabled) $v.hostPath.enabled }}
    {{- /* nim-llm's node-local cache; as there, persistence.enabled wins over hostPath and nfs */}}
    - name: nim-cache
      hostPath:
        path: {{ $v.hostPath.path }}
        type: DirectoryOrCreate
    {{- else if and (not $v.persistence.enabled) $v.nfs.enabled }}
    - name: nim-cache
      nfs:
        server: {{ $v.nfs.server | quote }}
        path: {{ $v.nfs.path | quote }}
        readOnly: {{ $v.nfs.readOnly }}
    {{- else if not $v.persistence.enabled }}
    - name: nim-cache
      emptyDir: {}
    {{- end }}
    {{- /* StatefulSet + persistence, no existing or shared claim: nim-cache comes from volumeClaimTemplates. */}}
    - name: tmp
      emptyDir:
        {{- with $v.tmp.sizeLimit }}
        sizeLimit: {{ . }}
        {{- else }} {}
        {{- end }}
    {{- if $v.shm.enabled }}
    - name: dshm
      emptyDir:
        medium: Memory
        {{- with $v.shm.sizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    {{- end }}
    {{- if $tls }}
    - name: tls
      secret:
        secretName: {{ $v.tls.secretName }}
        defaultMode: 0440
    {{- if and (eq $v.tls.mode "MTLS") $v.tls.clientSecretName }}
    - name: tls-client
      secret:
        secretName: {{ $v.tls.clientSecretName }}
        defaultMode: 0440
    {{- end }}
    {{- end }}
    {{- with $v.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
The cache claim's spec (standalone PVC or volumeClaimTemplate).
*/}}
{{- define "nim-torch.cacheClaimSpec" -}}
accessModes:
  {{- toYaml .Values.persistence.accessModes | nindent 2 }}
{{- with .Values.persistence.storageClass }}
storageClassName: {{ ternary "" . (eq . "-") | quote }}
{{- end }}
resources:
  requests:
    storage: {{ .Values.persistence.size }}
{{- end }}
