# combee: multi-stage build, slim non-root runtime with a health check.
# Build:  docker build -t combee .
# Run:    docker run -p 8080:8080 -e DATABASE_URL=postgres://… combee
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# jemalloc (the binary's allocator) is built from source with make.
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
# Dependencies first, so source edits don't rebuild them.
# The benchmarks (bench/) are a workspace member: only their manifest and stub
# sources are needed for cargo to load the workspace; they are not built.
COPY Cargo.toml Cargo.lock ./
COPY bench/Cargo.toml ./bench/
RUN mkdir -p src bench/src/bin && echo 'fn main() {}' > src/main.rs && echo '' > src/lib.rs \
    && for b in $(sed -n 's/^path = "\(src\/bin\/.*\)"/\1/p' bench/Cargo.toml); do mkdir -p "$(dirname "bench/$b")" && echo 'fn main() {}' > "bench/$b"; done \
    && cargo build --release --locked --bin combee \
    && rm -rf src
COPY build.rs ./
COPY src ./src
COPY migrations ./migrations
COPY prompts ./prompts
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin combee

FROM debian:bookworm-slim AS runtime
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin combee \
    && mkdir -p /app/data && chown combee /app/data
WORKDIR /app
COPY --from=build /src/target/release/combee /usr/local/bin/combee
COPY config ./config
USER combee
ENV COMBEE__SERVER__BIND=0.0.0.0:8080 \
    COMBEE__LOG__FORMAT=json \
    COMBEE__DATABASE__DATA_DIR=/app/data
EXPOSE 8080
VOLUME ["/app/data"]
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["combee", "health", "--url", "http://127.0.0.1:8080"]
ENTRYPOINT ["combee"]
CMD ["serve"]
