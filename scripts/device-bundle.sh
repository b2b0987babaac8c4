#!/usr/bin/env bash
# Packs built binaries and the shared libraries they need (beyond glibc and libstdc++) into
# .device/ so they run on a machine without liburing, Cap'n Proto or spdlog installed (the GPU
# device machine; CUDA's own libraries are left to its toolkit: export
# LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 there), with the tests' data in
# .device/fixtures. Usage: scripts/device-bundle.sh [BUILD_DIR] [BIN...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(expert-forge expert-bench expertd expertctl expert-tune)
rm -rf .device && mkdir -p .device/bin .device/lib
for b in "${bins[@]}"; do
  [ -x "$build/bin/$b" ] || continue
  cp "$build/bin/$b" .device/bin/
  strip --strip-debug ".device/bin/$b"
  ldd "$build/bin/$b" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*|libgcc_s*|libstdc++*) ;;
      # The device machine has its own CUDA 13 toolkit and driver (and cuBLAS is too big to carry).
      libcuda.so*|libcudart*|libcublas*|libnvidia*|libnvrtc*) ;;
      *) cp -n "$lib" .device/lib/ ;;
    esac
  done
done
# The tests' data (build/fixtures), found by the test binaries at bin/../fixtures.
if [ -d "$build/fixtures" ]; then cp -r "$build/fixtures" .device/fixtures; fi
du -sh .device
