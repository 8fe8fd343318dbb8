"""What the tools' tests share: the project's root and the files git tracks."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tracked_files() -> set[str]:
    """The repository's files, as git lists them."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {path for path in out.split("\0") if path}
