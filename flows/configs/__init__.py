"""The configurations vimeflow ships (package data): the embedded default run, `vimeflow train`'s default, the
tiny pipeline and the nightly baseline. Read through importlib.resources, so an installed package finds them."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def config_file(name: str) -> Path:
    """The shipped configuration `name` (e.g. "demo-engine.yaml"); a missing one is an error naming it."""
    resource = files(__name__).joinpath(name)
    if not resource.is_file():
        raise FileNotFoundError(f"vimeflow's built-in configuration {name} is missing ({resource}): the package "
                                "was built without its data files; reinstall it from a wheel or the source tree")
    return Path(str(resource))
