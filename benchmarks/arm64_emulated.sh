#!/bin/bash
# Build an emulated-aarch64 Python 3.11 environment on an x86-64 Debian host, so qtool
# can be run (and its ONNX output compared) on an ARM CPU without ARM hardware.
#
# Usage:  bash arm64_emulated.sh DIR QTOOL_REPO
#         then:  DIR/py -m qtool --help      (DIR/py behaves like `python`, QEMU_CPU=max etc. to change CPU)
#   DIR        new or empty directory to build into (~170 MB download, ~1 GB on disk)
#   QTOOL_REPO checkout of qtool, put on PYTHONPATH by DIR/py
#   HOST_PYTHON (env, default `python`): its `pip freeze` fixes the wheel versions; its pip does the download
#
# Creates:
#   DIR/qemu     qemu-user 10.x (bookworm-backports, static). qemu 7.2 from bookworm does NOT work:
#                it passes the host's x86 /proc/cpuinfo through and onnxruntime segfaults on import.
#   DIR/sysroot  Debian bookworm arm64 python3.11 + the shared libraries it and the wheels need
#   DIR/site     aarch64 wheels (onnx, onnxruntime, numpy, opencv, ... at the host's versions)
#   DIR/py       wrapper running DIR/sysroot/usr/bin/python3.11 under qemu-aarch64
#   DIR/apt, DIR/debs  private apt config/lists and the downloaded .debs (the host's apt is untouched)
set -euo pipefail

[ $# -eq 2 ] || { echo "usage: bash $0 DIR QTOOL_REPO" >&2; exit 2; }
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
REPO=$(cd "$2" && pwd)
HOST_PYTHON=${HOST_PYTHON:-python}
[ -z "$(ls -A "$DIR")" ] || { echo "error: $DIR is not empty" >&2; exit 1; }

# Top-level Python packages; their dependencies come along, pinned to the host's versions too.
# sympy: qtool's test extra installs it, and onnxruntime's symbolic shape inference, which
# qtool/graph/shapes.py asks for a model with contrib ops, needs it: the same packages as the host.
PKGS=(onnx onnxruntime numpy click tqdm opencv-python-headless PyYAML threadpoolctl sympy)
# arm64 python3.11 and the runtime libraries it (and the manylinux wheels: libstdc++, libgomp) load.
DEBS=(gcc-12-base libbz2-1.0 libc6 libcom-err2 libcrypt1 libdb5.3 libexpat1 libffi8 libgcc-s1
      libgomp1 libgssapi-krb5-2 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0 liblzma5
      libncursesw6 libnsl2 libpython3.11-minimal libpython3.11-stdlib libreadline8 libsqlite3-0
      libssl3 libstdc++6 libtinfo6 libtirpc3 libuuid1 libzstd1 python3.11-minimal python3.11
      zlib1g media-types tzdata)

echo "== 1. private apt setup (bookworm arm64 + bookworm-backports amd64)"
A=$DIR/apt
mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/sources.list.d" "$DIR/debs"
KEY=/usr/share/keyrings/debian-archive-keyring.gpg
cat > "$A/sources.list" <<EOF
deb [arch=arm64 signed-by=$KEY] http://deb.debian.org/debian bookworm main
deb [arch=arm64 signed-by=$KEY] http://deb.debian.org/debian bookworm-updates main
deb [arch=arm64 signed-by=$KEY] http://deb.debian.org/debian-security bookworm-security main
deb [arch=amd64 signed-by=$KEY] http://deb.debian.org/debian bookworm-backports main
EOF
APT=(apt-get -q -o Dir::Etc::SourceList="$A/sources.list" -o Dir::Etc::SourceParts="$A/sources.list.d"
     -o Dir::State::Lists="$A/lists" -o Dir::Cache="$A/cache" -o Dir::State::status=/dev/null
     -o APT::Architecture=arm64 -o APT::Architectures=arm64,amd64 -o APT::Sandbox::User=root)
"${APT[@]}" update

echo "== 2. download .debs (apt-get download writes to the cwd, hence the cd)"
cd "$DIR/debs"
"${APT[@]}" download qemu-user:amd64/bookworm-backports "${DEBS[@]}"   # apt's native arch here is arm64

echo "== 3. extract qemu and the sysroot"
dpkg -x qemu-user_*_amd64.deb "$DIR/qemu"
for d in *_arm64.deb *_all.deb; do dpkg -x "$d" "$DIR/sysroot"; done
"$DIR/qemu/usr/bin/qemu-aarch64" --version | head -1

echo "== 4. aarch64 wheels into $DIR/site, versions from $HOST_PYTHON's pip freeze"
"$HOST_PYTHON" -m pip freeze | grep -E '^[A-Za-z0-9._-]+==' > "$DIR/constraints.txt"
for p in "${PKGS[@]}"; do
  grep -qi "^$p==" "$DIR/constraints.txt" || { echo "error: $p not installed in $HOST_PYTHON" >&2; exit 1; }
done
PLAT=(--platform manylinux2014_aarch64)   # sysroot glibc is 2.36: accept manylinux_2_17 .. 2_36
for v in {17..36}; do PLAT+=(--platform "manylinux_2_${v}_aarch64"); done
"$HOST_PYTHON" -m pip install -q --target "$DIR/site" --only-binary=:all: --python-version 3.11 \
  --implementation cp "${PLAT[@]}" -c "$DIR/constraints.txt" "${PKGS[@]}"

echo "== 5. wrapper $DIR/py"
mkdir -p "$DIR/home/.cache"
cat > "$DIR/py" <<EOF
#!/bin/bash
# Python 3.11 (Debian bookworm arm64) under qemu-aarch64 user-mode emulation; made by arm64_emulated.sh.
# Usage: $DIR/py [python args...]   e.g.  $DIR/py -m qtool --help
# Emulated CPU: \$QEMU_CPU (default neoverse-n1; list: $DIR/qemu/usr/bin/qemu-aarch64 -cpu help).
export QEMU_CPU=\${QEMU_CPU:-neoverse-n1}
export QEMU_LD_PREFIX="$DIR/sysroot"
export PYTHONPATH="$DIR/site:$REPO\${ARM_EXTRA_PYTHONPATH:+:\$ARM_EXTRA_PYTHONPATH}"
export PYTHONNOUSERSITE=1
export PYTHONDONTWRITEBYTECODE=1          # keep .pyc out of $REPO
export HOME="$DIR/home"
export XDG_CACHE_HOME="$DIR/home/.cache"
unset PYTHONHOME PYTHONSTARTUP VIRTUAL_ENV
exec "$DIR/qemu/usr/bin/qemu-aarch64" "$DIR/sysroot/usr/bin/python3.11" "\$@"
EOF
chmod +x "$DIR/py"

echo "== 6. check"
"$DIR/py" -c "import platform, onnxruntime, numpy, cv2, onnx; print(platform.machine(), onnxruntime.__version__)"
echo "done: $DIR/py"
