#!/usr/bin/env bash
# Install the Debian packages a real node (e2e/node) needs when one is missing: containerd, runc,
# the CNI plugins, mmdebstrap (the images' base rootfs) and iproute2. Only as root on a Debian-like
# system with apt-get; elsewhere it says what is missing and exits 0 (the real-node tests then
# skip, or fail under STRATA_REQUIRE_E2E).
set -euo pipefail
need=()
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[[ -x /usr/lib/cni/bridge || -x /opt/cni/bin/bridge ]] || need+=(containernetworking-plugins)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v ip >/dev/null || need+=(iproute2)
if (( ${#need[@]} == 0 )); then exit 0; fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "real-node prerequisites missing: ${need[*]} (install them as root; the real-node tests skip)" >&2
  exit 0
fi
echo "installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >&2
apt-get install -y -q --no-install-recommends "${need[@]}" >&2
