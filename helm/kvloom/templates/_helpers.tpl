{{/*
Names. The full name is kept to 40 characters: KubeRay derives "<cluster>-head-svc" and
"<cluster>-gpu-worker-xxxxx" from "<fullname>-<index>", and those must stay DNS labels.
*/}}
{{- define "kvloom.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "kvloom.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvloom.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on objects the chart owns directly. */}}
{{- define "kvloom.labels" -}}
helm.sh/chart: {{ include "kvloom.chart" . }}
app.kubernetes.io/name: {{ include "kvloom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels on Ray pods. KubeRay adds its own (ray.io/cluster, ray.io/node-type, and
app.kubernetes.io/name=kuberay unless a label is already there); these are the ones the
Service selects on, chosen not to collide with KubeRay's.
*/}}
{{- define "kvloom.podSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ include "kvloom.name" . }}
{{- end }}

{{- define "kvloom.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* GPUs one replica uses: tensor parallel x decode context parallel. */}}
{{- define "kvloom.gpusPerReplica" -}}
{{- mul (int .Values.engine.tp) (int .Values.engine.dcp) }}
{{- end }}

{{/* Data-parallel model replicas in one RayCluster (engine.dataParallelSize, default 1). */}}
{{- define "kvloom.dataParallelSize" -}}
{{- int (default 1 .Values.engine.dataParallelSize) }}
{{- end }}

{{/* Worker pods per RayCluster, holding every data-parallel replica's grid; fails unless
tp x dcp is a multiple of worker.gpusPerPod (a pod never splits one replica's TP group). */}}
{{- define "kvloom.workerReplicas" -}}
{{- $gpus := int (include "kvloom.gpusPerReplica" .) }}
{{- $perPod := int .Values.worker.gpusPerPod }}
{{- if ne (mod $gpus $perPod) 0 }}
{{- fail (printf "worker.gpusPerPod (%d) must divide engine.tp x engine.dcp (%d x %d = %d GPUs per replica)" $perPod (int .Values.engine.tp) (int .Values.engine.dcp) $gpus) }}
{{- end }}
{{- mul (div $gpus $perPod) (int (include "kvloom.dataParallelSize" .)) }}
{{- end }}

{{/* Cross-field checks JSON Schema cannot express. Included once, by raycluster.yaml. */}}
{{- define "kvloom.validate" -}}
{{- $rayPorts := list 6379 8080 8265 10001 52365 }}
{{- $port := int .Values.server.port }}
{{- if has $port $rayPorts }}
{{- fail (printf "server.port %d collides with a Ray head port in the same pod (6379, 8080, 8265, 10001, 52365)" $port) }}
{{- end }}
{{- if .Values.server.metrics.enabled }}
{{- $metricsPort := int .Values.server.metrics.port }}
{{- if has $metricsPort $rayPorts }}
{{- fail (printf "server.metrics.port %d collides with a Ray head port in the same pod (6379, 8080, 8265, 10001, 52365)" $metricsPort) }}
{{- end }}
{{- if eq $metricsPort $port }}
{{- fail (printf "server.metrics.port must differ from server.port (both %d)" $port) }}
{{- end }}
{{- end }}
{{- if and (eq .Values.probes.type "grpc") .Values.tls.enabled }}
{{- fail "probes.type grpc cannot check a TLS server (kubelet's gRPC probe speaks plaintext only); use auto or exec" }}
{{- end }}
{{- end }}

{{/* "exec" or "grpc": the probe mechanism after resolving probes.type=auto. */}}
{{- define "kvloom.probeType" -}}
{{- if eq .Values.probes.type "auto" }}
{{- ternary "exec" "grpc" .Values.tls.enabled }}
{{- else }}
{{- .Values.probes.type }}
{{- end }}
{{- end }}

{{- define "kvloom.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "kvloom.fullname" .)) .Values.tls.existingSecret }}
{{- end }}

{{- define "kvloom.authSecretName" -}}
{{- default (printf "%s-auth" (include "kvloom.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* Name of the claim mounted at /models, when storage is a claim. */}}
{{- define "kvloom.modelClaimName" -}}
{{- if eq .Values.model.storage.type "existingClaim" }}
{{- .Values.model.storage.existingClaim }}
{{- else }}
{{- printf "%s-models" (include "kvloom.fullname" .) }}
{{- end }}
{{- end }}

{{- define "kvloom.modelOnClaim" -}}
{{- if has .Values.model.storage.type (list "pvc" "existingClaim") }}true{{ end }}
{{- end }}

{{/* The pod volume that backs /models. */}}
{{- define "kvloom.modelVolume" -}}
- name: models
{{- if include "kvloom.modelOnClaim" . }}
  persistentVolumeClaim:
    claimName: {{ include "kvloom.modelClaimName" . }}
{{- else if eq .Values.model.storage.type "hostPath" }}
  hostPath:
    path: {{ .Values.model.storage.hostPath.path }}
    type: {{ ternary "DirectoryOrCreate" "Directory" .Values.model.download.enabled }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.storage.emptyDir.sizeLimit }}
{{- end }}
{{- end }}

{{/* In-memory /dev/shm volume; argument: the size. */}}
{{- define "kvloom.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ . }}
{{- end }}

{{/* Shell that downloads the model once, leaving a marker file that later runs trust. */}}
{{- define "kvloom.downloadScript" -}}
{{- $dest := printf "/models/%s" .Values.model.dir -}}
set -eu
if [ -f {{ $dest }}/.kvloom-download-complete ]; then echo "model already at {{ $dest }}"; exit 0; fi
mkdir -p {{ $dest }}
hf download {{ .Values.model.download.repo }} --revision {{ .Values.model.download.revision }} --local-dir {{ $dest }}
touch {{ $dest }}/.kvloom-download-complete
{{- end }}

{{/* Environment of a download container: the Hub token, when one is configured. */}}
{{- define "kvloom.downloadEnv" -}}
- name: HF_HOME
  value: /tmp/hf-home
{{- with .Values.model.download.hfTokenSecret }}
{{- if .name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Init containers of every Ray pod: wait for the download Job (model on a claim) or download
in place (hostPath / emptyDir). Empty when download is off.
*/}}
{{- define "kvloom.modelInitContainers" -}}
{{- if .Values.model.download.enabled }}
{{- if include "kvloom.modelOnClaim" . }}
- name: wait-for-model
  image: {{ include "kvloom.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - /bin/bash
    - -c
    - until [ -f /models/{{ .Values.model.dir }}/.kvloom-download-complete ]; do echo "waiting for the model download job"; sleep 10; done
  volumeMounts:
    - name: models
      mountPath: /models
      readOnly: true
  resources:
    requests:
      cpu: 50m
      memory: 64Mi
    limits:
      memory: 64Mi
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
{{- else }}
- name: model-download
  image: {{ include "kvloom.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - /bin/bash
    - -c
    - |
      {{- include "kvloom.downloadScript" . | nindent 6 }}
  env:
    {{- include "kvloom.downloadEnv" . | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /models
  resources:
    {{- toYaml .Values.model.download.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
{{- end }}
{{- end }}
{{- end }}

{{/* Arguments of `kvloom serve`, one list item per word. */}}
{{- define "kvloom.serveArgs" -}}
- --model
- /models/{{ .Values.model.dir }}
- --host
- 0.0.0.0
- --port
- {{ .Values.server.port | int | quote }}
- --tp
- {{ .Values.engine.tp | int | quote }}
- --dcp
- {{ .Values.engine.dcp | int | quote }}
{{- if gt (int (include "kvloom.dataParallelSize" .)) 1 }}
- --data-parallel-size
- {{ include "kvloom.dataParallelSize" . | quote }}
- --routing
- {{ default "prefix" .Values.engine.routing }}
{{- end }}
- --dtype
- {{ .Values.engine.dtype }}
- --max-model-len
- {{ .Values.engine.maxModelLen | int | quote }}
- --block-size
- {{ .Values.engine.blockSize | int | quote }}
- --gpu-memory-utilization
- {{ .Values.engine.gpuMemoryUtilization | toString | quote }}
- --max-num-seqs
- {{ .Values.engine.maxNumSeqs | int | quote }}
{{- if not .Values.engine.prefixCaching }}
- --no-prefix-caching
{{- end }}
{{- if ne (default "auto" .Values.engine.kvCacheDtype) "auto" }}
- --kv-cache-dtype
- {{ .Values.engine.kvCacheDtype }}
{{- end }}
{{- if .Values.engine.deterministic }}
- --deterministic
{{- end }}
{{- with .Values.engine.speculativeConfig }}
- --speculative-config
- {{ toJson . | quote }}
{{- end }}
{{- if .Values.tls.enabled }}
- --tls-cert
- /etc/kvloom/tls/tls.crt
- --tls-key
- /etc/kvloom/tls/tls.key
{{- end }}
{{- if .Values.auth.enabled }}
- --auth-token-file
- /etc/kvloom/auth/{{ .Values.auth.secretKey }}
{{- end }}
{{- if .Values.server.metrics.enabled }}
- --metrics-port
- {{ .Values.server.metrics.port | int | quote }}
{{- end }}
{{- range .Values.engine.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/*
One probe handler on the serve container. Argument: (dict "ctx" $ "service" NAME "timing" T)
where T is one of .Values.probes.{startup,readiness,liveness}.
Native gRPC probes need a numeric port and plaintext; with TLS the bundled exec check runs.
*/}}
{{- define "kvloom.probeHandler" -}}
{{- $ctx := .ctx }}
{{- if eq (include "kvloom.probeType" $ctx) "grpc" }}
grpc:
  port: {{ $ctx.Values.server.port | int }}
  service: {{ .service | quote }}
{{- else }}
exec:
  command:
    - python
    - /etc/kvloom/probe/grpc_health_probe.py
    - --addr
    - 127.0.0.1:{{ $ctx.Values.server.port | int }}
    - --service
    - {{ .service | quote }}
    - --timeout
    - {{ sub (int .timing.timeoutSeconds) 1 | max 1 | quote }}
    {{- if $ctx.Values.tls.enabled }}
    - --tls-ca
    - /etc/kvloom/tls/{{ $ctx.Values.tls.probe.caKey }}
    - --tls-server-name
    - {{ default (printf "%s.%s.svc" (include "kvloom.fullname" $ctx) $ctx.Release.Namespace) $ctx.Values.tls.probe.serverName }}
    {{- end }}
    {{- if $ctx.Values.auth.enabled }}
    - --auth-token-file
    - /etc/kvloom/auth/{{ $ctx.Values.auth.secretKey }}
    {{- end }}
{{- end }}
{{- end }}
