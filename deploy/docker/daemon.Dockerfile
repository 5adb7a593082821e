# The daemon image: nothing but the static `sandmand` at /sandmand. Sandbox pods run it as an
# init container (`/sandmand install /.sandman/sandmand`) or mount it as an image volume; the
# hostPath DaemonSet installs it on each node. It needs no shell, libc or user database.
#
#   ctx=$(mktemp -d) && cp "$(./scripts/build-daemon)" "$ctx"
#   docker build -f deploy/docker/daemon.Dockerfile -t ghcr.io/sandman-dev/sandmand:0.1.0 "$ctx"
#
# Any directory holding `sandmand` will do as the context: daemon.Dockerfile.dockerignore keeps
# the rest out of it (BuildKit only; the legacy builder sends the whole directory).
FROM scratch
COPY sandmand /sandmand
ENTRYPOINT ["/sandmand"]
