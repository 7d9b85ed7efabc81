#!/usr/bin/env bash
# The base image of local builds, made from Debian's packages where no image registry is
# reachable: `debootstrap --variant=minbase bookworm` with Python 3.11 (python3, python3-venv),
# then `docker import`. Prints the image reference.
#
# The Dockerfile's default base is the public `python:3.11-slim-bookworm`; this one stands in
# for it (`make images` passes it as --build-arg BASE_IMAGE). The Dockerfile works on both: every
# stage installs into a virtual environment (/opt/venv), which Debian's own python3 requires
# (PEP 668 refuses `pip install` outside one) and the public image accepts.
#
# Cached by content: the tag is a checksum of this script and of the CA certificates it copies,
# so a second run on the machine finds the image and builds nothing (debootstrap: ~2 min).
#
# The machine's extra CA certificates (/usr/local/share/ca-certificates) go into the image's
# trust store: where the egress to PyPI passes a TLS-inspecting proxy, pip inside the build
# trusts what pip on the machine trusts. Only this local base carries them; a release build on
# the public base has Debian's store alone.
set -euo pipefail

SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates
here=$(cd "$(dirname "$0")" && pwd)
extra_cas=(/usr/local/share/ca-certificates/*.crt)
[ -e "${extra_cas[0]}" ] || extra_cas=()

sum=$( { cat "$here/base.sh"; echo "$MIRROR"; cat ${extra_cas[@]+"${extra_cas[@]}"}; } \
    | sha256sum | cut -c1-12)
image="corefleet-base:${SUITE}-${sum}"
if docker image inspect "$image" >/dev/null 2>&1; then
    echo "$image"
    exit 0
fi

root=$(mktemp -d /var/tmp/corefleet-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "base image: debootstrap $SUITE ($PACKAGES) into $root" >&2
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >&2
for ca in ${extra_cas[@]+"${extra_cas[@]}"}; do
    cp "$ca" "$root/usr/local/share/ca-certificates/"
done
chroot "$root" update-ca-certificates >&2
# apt inside a build reaches the same mirror; the lists and caches are not part of the image.
printf 'deb %s %s main\ndeb %s %s-updates main\n' "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" \
    > "$root/etc/apt/sources.list"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/log/*
tar --numeric-owner -C "$root" -c . \
    | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        - "$image" >&2
echo "$image"
