# The server image: nothing but the static `sandman` (serve and the CLI) at
# /usr/local/bin/sandman, run as 65532:65532. It needs no shell, libc, user database or CA
# bundle: in a pod it reaches the API server with its service account's token and CA, writes only
# to its state directory (the manifests mount a volume at /var/lib/sandman) and reads
# SANDMAN_TOKEN from the environment.
#
#   bin=$(./scripts/build-server)
#   docker build -f deploy/docker/server.Dockerfile -t ghcr.io/sandman-dev/sandman:0.1.0 "$(dirname "$bin")"
#
# The context is the binary's directory; server.Dockerfile.dockerignore keeps all but `sandman`
# out of it.
FROM scratch
COPY sandman /usr/local/bin/sandman
USER 65532:65532
EXPOSE 7777
ENTRYPOINT ["/usr/local/bin/sandman"]
CMD ["serve", "--listen", "0.0.0.0:7777", "--provider", "kubernetes"]
