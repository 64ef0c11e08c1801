"""SQLite files that only their owner can read.

The usage spool and the embedded SQLite database hold tenants' names, usage
and hashed keys. SQLite creates a new database file 0644 (less the umask),
and creates its -journal, -wal and -shm files with the main file's
permissions. So the main file is created here first, 0600 from the
`open(2)` that makes it (no window in which another user can read it), and
SQLite's own files inherit that. Files left 0644 by an older loragw are
tightened.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_MODE = 0o600
SIDE_FILES = ("-journal", "-wal", "-shm")


def create_private_sqlite_file(path: Path) -> None:
    """Create `path` (0600) unless it exists; tighten it and its side files if
    we own them. A missing directory is left for SQLite to report."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, PRIVATE_MODE))
    except FileExistsError:
        pass
    except FileNotFoundError:
        return
    for file in (path, *(path.with_name(path.name + suffix) for suffix in SIDE_FILES)):
        try:
            st = os.stat(file)
        except FileNotFoundError:
            continue
        if st.st_mode & 0o077 and st.st_uid == os.getuid():
            os.chmod(file, PRIVATE_MODE)
