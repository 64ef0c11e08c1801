"""The folder where loragw keeps what it makes once per host and finds again
in later processes: converted checkpoints (engine/model/loader.py) and
kernel calibrations (engine/model/calibration_cache.py).
`$LORAGW_CACHE_DIR`, else the user cache dir (~/.cache/loragw on Linux)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "LORAGW_CACHE_DIR"


def cache_root() -> Path:
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("loragw"))
