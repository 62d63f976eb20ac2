#!/usr/bin/env bash
# Mooncake's PyPI wheel (mooncake-transfer-engine-non-cuda) links libibverbs.so.1 even for TCP, and many machines
# lack it. Where the system has none, fetch Debian's libibverbs1 and the two libnl libraries it needs (~300 KB)
# and unpack them into $VENV/syslib, without installing anything system-wide (kvserve preloads them from there:
# kvserve/kv_transfer/common/mooncake.py). A private apt lists directory keeps the system's apt state untouched.
set -euo pipefail
VENV=${1:-.venv}
DEST="$VENV/syslib"
if ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then
    exit 0  # the system has it
fi
if [ -e "$DEST/libibverbs.so.1" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "warning: no libibverbs.so.1 and no apt-get: install libibverbs1 for the Mooncake store and transport" >&2
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
lists="$work/lists"
mkdir -p "$lists/partial" "$DEST"
# The download runs as root here (apt's _apt user cannot write a private temp directory): quiet that warning.
opts=(-o "Dir::State::Lists=$lists" -o "Dir::Cache=$work/cache" -o Debug::NoLocking=1 -o APT::Sandbox::User=root -qq)
apt-get "${opts[@]}" update
(cd "$work" && apt-get "${opts[@]}" download libibverbs1 libnl-3-200 libnl-route-3-200)
for deb in "$work"/*.deb; do
    dpkg-deb -x "$deb" "$work/root"
done
find "$work/root" \( -name 'libibverbs.so.1*' -o -name 'libnl-3.so.200*' -o -name 'libnl-route-3.so.200*' \) \
    -exec cp -a {} "$DEST/" \;
echo "libibverbs and libnl unpacked into $DEST"
