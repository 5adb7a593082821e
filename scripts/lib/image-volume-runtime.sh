# Sourced by ./scripts/e2e-kube and ./scripts/e2e-deploy.
#
# image_volume_runtime KUBECTL...: whether some node's runtime mounts image volumes, asked with
# the kubectl command given (e.g. `kubectl --kubeconfig FILE`): containerd 2.1+, CRI-O 1.31+
# (another runtime is given the benefit of the doubt). The kubelet asks any runtime for them, and
# an older one fails the container (containerd 1.x: `failed to mkdir ""`). When none does, sets
# `runtimes` to the nodes and their runtimes ("node-1: containerd://1.6.20") and fails.
image_volume_runtime() {
  local v
  for v in $("$@" get nodes -o jsonpath='{.items[*].status.nodeInfo.containerRuntimeVersion}'); do
    case $v in
      containerd://*) awk -F'[:/.]' '{ exit !($4 > 2 || ($4 == 2 && $5 >= 1)) }' <<<"$v" && return 0 ;;
      cri-o://*) awk -F'[:/.]' '{ exit !($4 > 1 || ($4 == 1 && $5 >= 31)) }' <<<"$v" && return 0 ;;
      *) return 0 ;;
    esac
  done
  runtimes=$("$@" get nodes -o jsonpath='{range .items[*]}{.metadata.name}: {.status.nodeInfo.containerRuntimeVersion}, {end}')
  runtimes=${runtimes%, }
  return 1
}
