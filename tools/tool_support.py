"""What the tools' tests share: the project's root, a tool loaded by its name, the files git tracks."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_tool(name: str):
    """The tool `name` (tools/<folder>/<name>.py) as a module."""
    path, = (ROOT / "tools").glob(f"*/{name}.py")  # tools/handout/, tools/checks/, ...
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module




def tracked_files() -> set[str]:
    """The repository's files, as git lists them."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {path for path in out.split("\0") if path}
