# syntax=docker/dockerfile:1
# The server image: `sandman` (serve and the CLI) on a distroless base, running as non-root.
#
#   docker build -f deploy/docker/server.Dockerfile -t ghcr.io/sandman-dev/sandman:0.1.0 .
#
# Built from the repository root; server.Dockerfile.dockerignore keeps target/ out of the context.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p sandman-cli \
    && cp target/release/sandman /sandman

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /sandman /usr/local/bin/sandman
USER 65532:65532
EXPOSE 7777
ENTRYPOINT ["/usr/local/bin/sandman"]
CMD ["serve", "--listen", "0.0.0.0:7777", "--provider", "kubernetes"]
