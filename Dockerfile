# Two images from one file: `--target gateway` (the OpenAI-compatible gateway: no torch, no GPU) and the
# default last stage, the Stoker GPU worker.

# ---- gateway: the base install plus starlette/uvicorn; a slim Python base, since it never touches a GPU.
FROM python:3.12-slim AS gateway
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['gateway']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt
COPY . .
# The Batch API's files (--storage-path): made here, owned by stoker, so a fresh named volume mounted on it
# (docker-compose.yml) starts writable by the gateway.
RUN pip install --no-deps ".[gateway]" && pip check \
 && useradd --create-home stoker \
 && mkdir -p /var/lib/stoker/batches && chown stoker /var/lib/stoker/batches
USER stoker
EXPOSE 8000
ENTRYPOINT ["stoker-gateway"]

# ---- worker. torch's wheels carry their own CUDA libraries; the CUDA base image gives the matching user-space
# stack the NVIDIA container toolkit expects, and gcc + Python headers are here because Triton compiles a small
# C launcher for each kernel the first time it runs. The base's CUDA must be the one the pinned torch wheel
# brings: torch 2.11 from PyPI requires cuda-toolkit==13.0.2 (its wheel metadata; tests/test_compose.py checks
# this against the installed torch), so the host driver must support CUDA 13.0 (R580 or newer).
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04 AS worker

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && ln -s /opt/venv/bin/python /usr/local/bin/python

WORKDIR /app
# Dependencies first, read from pyproject.toml, so editing our code does not reinstall torch.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['worker']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

COPY . .
# pip install .[worker]: the dependencies are already there, this adds our packages and `stoker-worker`.
RUN pip install --no-deps ".[worker]" && pip check

RUN useradd --create-home stoker
USER stoker
# The Triton cache directory exists in the image and belongs to `stoker`, so a named volume mounted there
# (compose: triton-cache) starts with that owner and keeps compiled kernels across container restarts.
ENV HOME=/home/stoker TRITON_CACHE_DIR=/home/stoker/.triton
RUN mkdir -p "$TRITON_CACHE_DIR"
EXPOSE 9400
ENTRYPOINT ["stoker-worker"]
