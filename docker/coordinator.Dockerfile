# batchfleet coordinator image (no libtorch: it validates, plans, publishes and follows).
#   docker build -f docker/coordinator.Dockerfile -t batchfleet-coordinator .
FROM rust:1.95-slim-bookworm AS chef
RUN cargo install cargo-chef --locked --version 0.1.78
WORKDIR /src

# The dependency graph alone: reused while only batchfleet's code changes.
FROM chef AS plan
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

# Dependencies built once per dependency change, then batchfleet itself.
FROM chef AS build
COPY --from=plan /src/recipe.json recipe.json
RUN cargo chef cook --release -p batchfleet-coordinator --no-default-features --recipe-path recipe.json
COPY . .
RUN cargo build --release -p batchfleet-coordinator --no-default-features --bin batchfleet \
 && cp target/release/batchfleet /usr/local/bin/

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home batchfleet
COPY --from=build /usr/local/bin/batchfleet /usr/local/bin/batchfleet
USER 10001
ENV BATCHFLEET_METRICS_PORT=9101 \
    BATCHFLEET_NO_PROGRESS=true
EXPOSE 9101
# The coordinator runs a job and exits; while it runs, its metrics endpoint answers.
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s \
  CMD ["sh", "-c", "curl -fsS http://127.0.0.1:${BATCHFLEET_METRICS_PORT}/metrics >/dev/null"]
ENTRYPOINT ["/usr/local/bin/batchfleet"]
CMD ["--help"]
