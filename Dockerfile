# Two images from one file:
#   docker build --target api .     Flask API, migrations, Flower (no torch, no vLLM)
#   docker build --target worker .  Celery worker with the CUDA build of vLLM
# Each installs its dependencies from its lock (locks/api.txt, locks/worker-gpu.txt, written by
# scripts/lock.py from pyproject.toml): every package at a pinned version and hash, then the
# project itself without dependencies. The locks are for linux/amd64.

# --- api: plain Python is enough (no torch, no compiler) ------------------------------------
FROM python:3.11-slim AS api
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# It runs as this user, not root (USER below): the API, the migrations and Flower write nothing
# outside /tmp. A numeric UID, so that Kubernetes' runAsNonRoot can verify it (deploy/k8s).
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin thinkbatch
WORKDIR /app
# Dependencies before the sources: a code change reuses this layer.
COPY locks/api.txt ./locks/
RUN pip install --require-hashes --no-deps -r locks/api.txt
COPY pyproject.toml README.md ./
COPY thinkbatch ./thinkbatch
COPY api ./api
COPY worker ./worker
COPY migrations ./migrations
# Flower's Tasks page columns: the job id (args) and its progress (result).
COPY flowerconfig.py ./
# The project alone: every dependency is installed above, at its locked version.
# hadolint ignore=DL3013
RUN pip install --no-deps .
USER 10001:10001
EXPOSE 8000
CMD ["gunicorn", "-c", "api/gunicorn.conf.py", "api.asgi:app"]

# --- worker: a CUDA *devel* base, because vLLM compiles kernels when its engine starts -------
# * Triton (vLLM's samplers use it even in eager mode) builds its CUDA launcher with gcc and the
#   Python headers on first use: python:3.11-slim has neither.
# * The FlashInfer sampler, on by default in vLLM 0.32, compiles with nvcc during the engine's
#   warm-up and has no fallback: a runtime-only CUDA image has no nvcc.
# So: NVIDIA's devel image at the CUDA version the pinned torch is built for (the `gpu` extra's
# vLLM pins a torch whose PyPI wheels use CUDA 13.0: cuda-toolkit 13.0.x in locks/worker-gpu.txt,
# which tests/unit/test_deploy.py checks against this tag), plus gcc and the Python headers. vLLM's own
# release image uses the same kind of base for the same reason. The alternative, switching
# FlashInfer's sampler off (VLLM_USE_FLASHINFER_SAMPLER=0) and keeping a slim image, still needs
# gcc for Triton and costs sampling speed; it is not taken.
# The host needs an NVIDIA driver >= 580 (CUDA 13.0); `make gpu-check` checks it.
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04 AS worker
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 CUDA_HOME=/usr/local/cuda PATH=/opt/venv/bin:$PATH
# What the engine compiles at its first start (torch.compile's graphs, CUDA graphs' kernels,
# Triton's launcher, FlashInfer's sampler: minutes) goes to one directory, /cache, which compose
# and Kubernetes keep on a volume so that later starts reuse it. The model goes to HF_HOME.
ENV HF_HOME=/hf VLLM_CACHE_ROOT=/cache/vllm TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor FLASHINFER_WORKSPACE_BASE=/cache
# Ubuntu 24.04's Python 3.12 (vLLM's wheel is abi3; thinkbatch needs >= 3.11). Debian package
# versions move with the base image's security updates; the base image tag pins them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev gcc g++ git ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin thinkbatch \
    && mkdir -p /hf /cache \
    && chown 10001:10001 /hf /cache
WORKDIR /app
# The `worker` and `gpu` extras' whole tree: vLLM, the CUDA build of torch and its CUDA libraries.
COPY locks/worker-gpu.txt ./locks/
RUN pip install --require-hashes --no-deps -r locks/worker-gpu.txt
COPY pyproject.toml README.md ./
COPY thinkbatch ./thinkbatch
COPY api ./api
COPY worker ./worker
COPY migrations ./migrations
COPY scripts ./scripts
# hadolint ignore=DL3013
RUN pip install --no-deps .
# Not root: the api image's UID. /hf and /cache (made above) belong to it, so that an empty
# volume mounted there starts out writable by it (Docker copies the ownership into a new volume).
USER 10001:10001
CMD ["celery", "-A", "worker.celery_app", "worker", "-E", "-l", "INFO"]
