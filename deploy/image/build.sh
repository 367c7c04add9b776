#!/usr/bin/env bash
# Builds the kvproxy image from deploy/Dockerfile with podman (`make image`).
#
#   deploy/image/build.sh IMAGE
#
# The Dockerfile's base is an argument (PYTHON_IMAGE, published default
# python:3.11.x-slim-bookworm). Image registries are not reachable from the project's build
# and CI machines, Debian's archive and PyPI are (shared/facts/CONTAINERS.md), so unless
# KVPROXY_BASE_IMAGE names a base to use instead, the base is made here: Debian bookworm by
# `debootstrap --variant=minbase` with python3 and python3-venv (Python 3.11, as the test
# suite), from the archive apt uses, imported into podman as
# localhost/kvproxy-base:bookworm-<hash of its recipe>. It stays in podman's storage and is
# reused while the recipe below is unchanged (KVPROXY_BASE_REBUILD=1 makes it again); a
# machine without it builds it.
#
# Installs what it needs when missing and when root (podman, runc, debootstrap: apt-get
# update first). Podman runs with deploy/image/containers.conf unless CONTAINERS_CONF is set.
set -euo pipefail

image=${1:?usage: deploy/image/build.sh IMAGE}
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
export CONTAINERS_CONF=${CONTAINERS_CONF:-$repo/deploy/image/containers.conf}

# The base's recipe: any change here gives the base a new tag, so it is made again.
BASE_SUITE=bookworm
BASE_PACKAGES=python3,python3-venv
BASE_RECIPE="debootstrap --variant=minbase --include=$BASE_PACKAGES $BASE_SUITE; trimmed v1"
base_tag=localhost/kvproxy-base:$BASE_SUITE-$(printf '%s' "$BASE_RECIPE" | sha256sum | cut -c1-12)

say() { printf 'image: %s\n' "$*" >&2; }

install_missing() {
  local missing=() tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    say "missing ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root"
    exit 1
  fi
  say "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The archive apt uses here (deb822 sources first, then sources.list), else Debian's CDN.
debian_mirror() {
  local uri=""
  if [ -n "${KVPROXY_DEBIAN_MIRROR:-}" ]; then
    echo "$KVPROXY_DEBIAN_MIRROR"
    return
  fi
  if [ -r /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -r /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' /etc/apt/sources.list)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

make_base() {
  if [ "$(id -u)" != 0 ]; then
    say "making the Debian base needs root (debootstrap); or set KVPROXY_BASE_IMAGE"
    exit 1
  fi
  local rootfs mirror
  mirror=$(debian_mirror)
  rootfs=$(mktemp -d /var/tmp/kvproxy-base.XXXXXX)
  # shellcheck disable=SC2064  # the path is fixed now
  trap "rm -rf '$rootfs'" EXIT
  say "debootstrap $BASE_SUITE ($BASE_PACKAGES) from $mirror"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$BASE_SUITE" "$rootfs" "$mirror" \
    >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
  rm -f "$rootfs.log"
  # What a container never reads: package caches and lists, documentation, translations.
  rm -rf "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
    "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
  tar -C "$rootfs" --numeric-owner -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "$BASE_RECIPE (mirror $mirror)" - "$base_tag" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
}

install_missing podman runc
start=$(date +%s)
if [ -n "${KVPROXY_BASE_IMAGE:-}" ]; then
  base=$KVPROXY_BASE_IMAGE
else
  base=$base_tag
  if [ -n "${KVPROXY_BASE_REBUILD:-}" ] || ! podman image exists "$base"; then
    install_missing debootstrap
    make_base
  fi
  say "base $base ($(podman image inspect --format '{{.Size}}' "$base" | numfmt --to=iec) bytes)"
fi
# --network=host: the build stage installs wheels from PyPI the way the host reaches it, and
# with the host's CA bundle (this network's egress proxy re-signs TLS with its own CA):
# mounted for the RUN steps only, never stored in the image. Debian's pip reads that path;
# KVPROXY_BUILD_CA= (empty) builds without it.
ca=${KVPROXY_BUILD_CA-/etc/ssl/certs/ca-certificates.crt}
trust=()
if [ -n "$ca" ] && [ -r "$ca" ]; then
  trust=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
fi
podman build --network=host --pull=missing "${trust[@]}" \
  --file deploy/Dockerfile --ignorefile deploy/Dockerfile.dockerignore \
  --build-arg PYTHON_IMAGE="$base" --tag "$image" .
size=$(podman image inspect --format '{{.Size}}' "$image" | numfmt --to=iec)
say "built $image from $base in $(($(date +%s) - start)) s, $size bytes"
