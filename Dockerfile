# tiergate on CPU: the transformers chat engine, the demo models built in, JSON logs.
#   docker build -t tiergate:cpu .
#   docker run -p 8000:8000 -e TIERGATE_KEYS_PAID=sk-... --stop-timeout 40 tiergate:cpu
# Mount your own tiers.yaml over /app/tiers.yaml (and models under /app/models) to serve others.
# Stopping drains: SIGTERM lets requests in flight finish for server.drain_timeout_s (30 s by
# default), so give `docker stop` a longer --stop-timeout (Compose: stop_grace_period).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# libsndfile: speech and transcription audio (soundfile)
# (the distribution's current libsndfile is the one wanted: its version is not pinned)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libsndfile1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, the CPU build (as scripts/bootstrap.sh does), so nothing later pulls a CUDA build
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"

# the packages pyproject.toml lists, and tiers.yaml (.dockerignore keeps the rest out)
COPY . .
RUN pip install . \
    && tiergate demo-models --out /app/demo-models

RUN useradd --create-home --uid 10001 tiergate && mkdir -p /app/tiergate-data && chown tiergate /app/tiergate-data
USER 10001

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"]
CMD ["tiergate", "serve", "--config", "/app/tiers.yaml", "--host", "0.0.0.0", "--port", "8000", "--log-format", "json"]
