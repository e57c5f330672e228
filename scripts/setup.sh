#!/usr/bin/env bash
# Installs what ferry's build, guests and tests need on a fresh Debian machine (run as root,
# or with the packages already present), then fetches the pinned CPython guest.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
need=()
command -v clang >/dev/null || need+=(clang)
command -v wasm-ld >/dev/null || command -v wasm-ld-14 >/dev/null || need+=(lld)
[ -d /usr/include/wasm32-wasi ] || [ -d /usr/lib/wasm32-wasi ] || need+=(wasi-libc)
ls /usr/lib/llvm-14/lib/clang/*/lib/wasi/libclang_rt.builtins-wasm32.a >/dev/null 2>&1 || need+=(libclang-rt-14-dev-wasm32)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
# The S3 server of the tests (scripts/fetch-moto.sh) runs in a virtual environment.
python3 -c "import ensurepip" >/dev/null 2>&1 || need+=(python3-venv)
command -v make >/dev/null || need+=(make) # jemalloc, ferry's allocator, is built from C
# A snapshot through a container registry (test `capsule::a_snapshot_moves_through_a_container_registry`):
# skopeo, and the registry's binary (below: unpacked, not installed, so no registry service
# starts listening on this machine).
command -v skopeo >/dev/null || need+=(skopeo)
# The JavaScript space's tests run on Node 24, fetched with npm (scripts/fetch-node.sh).
command -v npm >/dev/null || need+=(npm)
# Another CPU: the JavaScript space's tests also resume snapshots in Node for arm64 under
# qemu-user (tests `other_cpu::*`), with the arm64 C and C++ runtime libraries it links.
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
[ -e /usr/aarch64-linux-gnu/lib/libstdc++.so.6 ] || need+=(libstdc++6-arm64-cross)
[ -e /usr/aarch64-linux-gnu/lib/libgcc_s.so.1 ] || need+=(libgcc-s1-arm64-cross)
[ -e /usr/aarch64-linux-gnu/lib/libc.so.6 ] || need+=(libc6-arm64-cross)
# A peer that goes silent mid-migration (tests `migrate::a_destination_that_goes_silent_*`):
# nftables drops every packet to and from one port, as a powered-off machine would.
command -v nft >/dev/null || need+=(nftables)
# Spaces serving HTTPS (test `migrate::spaces_serving_https_*`): a test CA made with openssl.
command -v openssl >/dev/null || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
fi
# A browser for the JavaScript space's tab tests: Chromium without a window, and without the
# packages it merely recommends (systemd, avahi, ...).
if ! command -v chromium-headless-shell >/dev/null; then
    echo "setup: installing chromium-headless-shell"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends chromium-headless-shell >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium-headless-shell >/dev/null; }
fi
tools="${FERRY_TOOLS:-$HOME/.cache/ferry/tools}"
if ! command -v docker-registry >/dev/null && [ ! -x "$tools/docker-registry" ]; then
    echo "setup: unpacking Debian's docker-registry into $tools"
    work="$(mktemp -d)"
    (cd "$work" && { apt-get download docker-registry >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get download docker-registry >/dev/null; }; } \
        && dpkg-deb -x docker-registry_*.deb unpacked \
        && install -D unpacked/usr/bin/docker-registry "$tools/docker-registry")
    rm -rf "$work"
fi
# A fleet of spaces sharing an etcd (tests `fleet::*`): Debian's etcd and etcdctl, unpacked
# like the registry, so no etcd service starts on this machine.
for pkg in etcd-server:etcd etcd-client:etcdctl; do
    deb="${pkg%%:*}" bin="${pkg##*:}"
    if ! command -v "$bin" >/dev/null && [ ! -x "$tools/$bin" ]; then
        echo "setup: unpacking Debian's $deb into $tools"
        work="$(mktemp -d)"
        (cd "$work" && { apt-get download "$deb" >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get download "$deb" >/dev/null; }; } \
            && dpkg-deb -x "${deb}"_*.deb unpacked \
            && install -D "unpacked/usr/bin/$bin" "$tools/$bin")
        rm -rf "$work"
    fi
done
"$root/guests/build.sh"
"$root/scripts/fetch-python.sh"
"$root/scripts/fetch-python315.sh"
"$root/scripts/fetch-sqlite.sh"
"$root/scripts/fetch-zstd.sh"
"$root/scripts/fetch-programs.sh"
"$root/scripts/fetch-node.sh"
"$root/scripts/fetch-moto.sh"
