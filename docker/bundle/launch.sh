#!/bin/sh
# Runs libexec/batchfleet/<this name> against the libtorch of this machine's
# PyTorch: the folder BATCHFLEET_LIBTORCH_DIR names, else the lib/ folder of
# the `torch` package that python3 (BATCHFLEET_PYTHON) imports — located
# without importing it. The PyTorch must be the one the bundle was built
# against (BUILD); its CUDA libraries are found where it finds them.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
name=$(basename "$0")
want=$(sed -n 's/^torch \([0-9.]*\).*/\1/p' "$here/BUILD")
if [ -n "${BATCHFLEET_LIBTORCH_DIR:-}" ]; then
  lib=$BATCHFLEET_LIBTORCH_DIR
  found="BATCHFLEET_LIBTORCH_DIR"
else
  py=${BATCHFLEET_PYTHON:-python3}
  pkg=$("$py" -c 'import importlib.util as u; s = u.find_spec("torch"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null || true)
  if [ -z "$pkg" ]; then
    echo "$name: no PyTorch found: $py has no torch package. Install torch==$want (pip install torch==$want), name another Python with BATCHFLEET_PYTHON, or a libtorch lib folder with BATCHFLEET_LIBTORCH_DIR" >&2
    exit 69
  fi
  lib="$pkg/lib"
  found="the torch package of $py ($pkg)"
  have=$(sed -n "s/^__version__ = ['\"]\([0-9.]*\).*/\1/p" "$pkg/version.py" 2>/dev/null || true)
  if [ -n "$have" ] && [ "$have" != "$want" ]; then
    echo "$name: this bundle was built against PyTorch $want, but $found is PyTorch $have: libtorch's C++ interface differs between releases. Use the bundle built for $have (make gpu-bundle TORCH=$have) or install torch==$want" >&2
    exit 69
  fi
fi
if [ ! -f "$lib/libtorch_cpu.so" ]; then
  echo "$name: no libtorch_cpu.so in $lib (from $found)" >&2
  exit 69
fi
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "$here/libexec/batchfleet/$name" "$@"
