# Two images from one file:
#   docker build --target api .     Flask API, migrations, Flower (no torch, no vLLM)
#   docker build --target worker .  Celery worker with the CUDA build of vLLM
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY thinkbatch ./thinkbatch
COPY api ./api
COPY worker ./worker
COPY demo ./demo
COPY bench ./bench
COPY migrations ./migrations

FROM base AS api
RUN pip install ".[api,worker]"
EXPOSE 8000
CMD ["gunicorn", "-c", "api/gunicorn.conf.py", "api.wsgi:app"]

FROM base AS worker
RUN pip install ".[worker,gpu]"
CMD ["celery", "-A", "worker.celery_app", "worker", "-E", "-l", "INFO"]
