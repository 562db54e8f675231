#!/usr/bin/env bash
# Prepares .devdeps/: the Debian build dependencies a GPU machine without them lacks (fmt,
# nlohmann-json, CLI11, GoogleTest, PCRE2), unpacked from their .debs into a prefix that
# scripts/device_build.sh points CMake at. Run here (Debian); carry .devdeps to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .devdeps && mkdir -p .devdeps/debs
(cd .devdeps/debs && apt-get download -q libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev googletest libpcre2-dev \
  2>/dev/null)
for deb in .devdeps/debs/*.deb; do dpkg -x "$deb" .devdeps/root; done
rm -rf .devdeps/debs
echo "device deps: $(du -sh .devdeps | cut -f1) in .devdeps/root"
