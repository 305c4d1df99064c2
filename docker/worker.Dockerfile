# batchfleet worker image. Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t batchfleet-worker:cpu .
#   docker build -f docker/worker.Dockerfile --build-arg VARIANT=cuda -t batchfleet-worker:cuda .
# libtorch comes from the PyTorch wheel (CPU or CUDA 13.0 build) installed
# at the same path in both stages, so the rpath the build embeds holds.
ARG VARIANT=cpu

FROM rust:1.95-slim-bookworm AS chef
ARG VARIANT
ARG TORCH_VERSION=2.13.0
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip pkg-config gcc g++ \
 && rm -rf /var/lib/apt/lists/*
RUN cargo install cargo-chef --locked --version 0.1.78 \
 && python3 -m venv /opt/torch
RUN if [ "$VARIANT" = cuda ]; then index=https://download.pytorch.org/whl/cu130; else index=https://download.pytorch.org/whl/cpu; fi \
 && /opt/torch/bin/pip install --no-cache-dir --index-url "$index" "torch==${TORCH_VERSION}" \
 && mkdir -p /opt/torch/lib/python3.11/site-packages/nvidia
ENV VIRTUAL_ENV=/opt/torch PATH=/opt/torch/bin:$PATH LIBTORCH_USE_PYTORCH=1
WORKDIR /src

# The dependency graph alone (Cargo.toml and Cargo.lock files): unchanged
# by an edit to batchfleet's own code, so the next stage's layer is reused.
FROM chef AS plan
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

# Dependencies built once per dependency change (tch, arrow, parquet, …),
# then batchfleet itself.
FROM chef AS build
COPY --from=plan /src/recipe.json recipe.json
RUN cargo chef cook --release -p batchfleet-worker --recipe-path recipe.json
COPY . .
RUN cargo build --release -p batchfleet-worker --bin batchfleet-worker \
 && cp target/release/batchfleet-worker /usr/local/bin/

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home batchfleet
# Only torch's shared libraries (and CUDA's, for the cuda variant) — no Python at run time.
COPY --from=build /opt/torch/lib/python3.11/site-packages/torch/lib /opt/torch/lib/python3.11/site-packages/torch/lib
COPY --from=build /opt/torch/lib/python3.11/site-packages/nvidia /opt/torch/lib/python3.11/site-packages/nvidia
COPY --from=build /usr/local/bin/batchfleet-worker /usr/local/bin/batchfleet-worker
USER 10001
ENV BATCHFLEET_METRICS_PORT=9100 \
    BATCHFLEET_LOG_FORMAT=json
EXPOSE 9100
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s \
  CMD ["sh", "-c", "curl -fsS http://127.0.0.1:${BATCHFLEET_METRICS_PORT}/metrics >/dev/null"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/batchfleet-worker"]
