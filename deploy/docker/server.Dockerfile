# The server image: nothing but the static `sandman` (serve and the CLI) at
# /usr/local/bin/sandman, run as 65532:65532. It needs no shell, libc, user database or CA
# bundle: in a pod it reaches the API server with its service account's token and CA, writes only
# to its state directory (/var/lib/sandman/sandman, in the volume the manifests mount at
# /var/lib/sandman) and reads
# SANDMAN_TOKEN from the environment.
#
#   ctx=$(mktemp -d) && cp "$(./scripts/build-server)" "$ctx"
#   docker build -f deploy/docker/server.Dockerfile -t ghcr.io/sandman-dev/sandman:0.1.0 "$ctx"
#
# Any directory holding `sandman` will do as the context: server.Dockerfile.dockerignore keeps
# the rest out of it (BuildKit only; the legacy builder sends the whole directory).
FROM scratch
COPY sandman /usr/local/bin/sandman
USER 65532:65532
EXPOSE 7777
ENTRYPOINT ["/usr/local/bin/sandman"]
CMD ["serve", "--listen", "0.0.0.0:7777", "--provider", "kubernetes"]
