#!/usr/bin/env bash
# The system packages rltt needs beyond Python: bubblewrap (bwrap), which confines the python tool's
# calls in namespaces of their own, and libseccomp2, whose filter it loads (docs/tools.md).
# Installs them with apt-get when run as root on Debian/Ubuntu; otherwise says what to run.
set -euo pipefail
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || missing+=(libseccomp2)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "install_system_deps.sh: installed ${missing[*]}"
else
  echo "install_system_deps.sh: missing ${missing[*]}: the python tool refuses to run without them;" \
       "install them as root (Debian/Ubuntu: apt-get install ${missing[*]}; Fedora: dnf install bubblewrap libseccomp)" >&2
fi
