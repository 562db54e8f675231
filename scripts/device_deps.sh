#!/usr/bin/env bash
# Prepares .devdeps/: the Debian build dependencies a GPU machine without them lacks (fmt,
# nlohmann-json, CLI11, GoogleTest, PCRE2, cpp-httplib with the headers it includes and the shared
# libraries it links), unpacked from their .debs into a prefix that scripts/device_build.sh points
# CMake at. Run here (Debian); carry .devdeps to the GPU machine. The tpmoe binary finds
# libcpp-httplib.so there through the RPATH CMake records (a folder outside the system's).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .devdeps && mkdir -p .devdeps/debs
(cd .devdeps/debs && apt-get download -q libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev googletest libpcre2-dev \
  libcpp-httplib-dev libcpp-httplib0.11 libssl-dev libssl3 zlib1g-dev libbrotli-dev libbrotli1 \
  2>/dev/null)
for deb in .devdeps/debs/*.deb; do dpkg -x "$deb" .devdeps/root; done
rm -rf .devdeps/debs
echo "device deps: $(du -sh .devdeps | cut -f1) in .devdeps/root"
