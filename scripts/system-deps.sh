#!/usr/bin/env bash
# System packages the tests need that pip cannot install: the OCI registry (CNCF distribution,
# Debian's docker-registry) that tests/test_oci.py publishes to and pulls from. Idempotent: a no-op
# when it is already installed.
set -euo pipefail
if ! command -v docker-registry >/dev/null 2>&1 && [ ! -x /usr/bin/docker-registry ]; then
    SUDO=""
    if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends docker-registry
fi
