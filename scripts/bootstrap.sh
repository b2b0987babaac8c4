#!/usr/bin/env bash
# Installs everything expertd needs to build and test on Debian 12 (run as root; idempotent).
# The CUDA toolkit is not a Debian package here: it is expected at /usr/local/cuda, and without it
# the build leaves the GPU engine out and says so.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config git
  clang clang-format libclang-rt-14-dev
  liburing-dev capnproto libcapnp-dev libxxhash-dev
  libpcre2-dev libutf8proc-dev
  libspdlog-dev libfmt-dev libtomlplusplus-dev libcli11-dev nlohmann-json3-dev
  libboost1.74-dev  # expert-serve: Boost.Beast and Asio (headers)
  libsystemd-dev systemd
  debootstrap systemd-container  # scripts/systemd-check.sh: systemd as PID 1 in systemd-nspawn
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  python3 python3-venv python3-pip
  librsvg2-bin
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "bootstrap: missing packages and not root: run as root (or with sudo)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "bootstrap: all Debian packages present"
fi

# Python is for tools and cross-checks only (llama.cpp's `gguf` package reads our files; the
# official `openai` client drives expert-serve in its test).
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import gguf, numpy, openai' 2>/dev/null; then
  echo "bootstrap: creating .venv with gguf, numpy and openai"
  /usr/bin/python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check gguf==0.19.0 numpy openai
else
  echo "bootstrap: .venv has gguf, numpy and openai"
fi

if [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "bootstrap: CUDA toolkit found: $(/usr/local/cuda/bin/nvcc --version | tail -n 1)"
else
  echo "bootstrap: no CUDA toolkit at /usr/local/cuda: the GPU engine will not be built"
fi
