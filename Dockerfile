# The Stoker GPU worker. torch's wheels carry their own CUDA libraries; the CUDA base image gives the
# matching user-space stack the NVIDIA container toolkit expects, and gcc + Python headers are here because
# Triton compiles a small C launcher for each kernel the first time it runs.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

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
ENV HOME=/home/stoker TRITON_CACHE_DIR=/home/stoker/.triton
EXPOSE 9400
ENTRYPOINT ["stoker-worker"]
