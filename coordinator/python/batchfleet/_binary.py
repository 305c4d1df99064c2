"""Where the batchfleet binaries are."""

from __future__ import annotations

import os
import shutil

_HERE = os.path.dirname(os.path.abspath(__file__))


def binary(name: str = "batchfleet") -> str:
    """The path of batchfleet binary ``name``: the one in
    ``$BATCHFLEET_BIN_DIR`` if that is set, else the one this package
    carries (``batchfleet/_bin/``, in the wheel), else the first on ``PATH``."""
    folder = os.environ.get("BATCHFLEET_BIN_DIR")
    if folder:
        path = os.path.join(folder, name)
        if not os.access(path, os.X_OK):
            raise FileNotFoundError(f"BATCHFLEET_BIN_DIR={folder} holds no executable {name}")
        return path
    bundled = os.path.join(_HERE, "_bin", name)
    if os.access(bundled, os.X_OK):
        return bundled
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"no {name} binary: install the batchfleet wheel (`make wheel`, then "
            f"`pip install dist/batchfleet-*.whl`), or set BATCHFLEET_BIN_DIR to the folder "
            f"holding the binaries (target/release in a build from source)"
        )
    return found
