"""Build-time smoke check: import what the image promises and compare versions with its labels.

Usage: ``python smoke_check.py torch=2.7.1 torch_npu=2.7.1.post1 vime_engine dist:transformer-engine=2.20.2``

- ``module`` imports the module;
- ``module=VERSION`` also checks its version (``__version__``, else the installed distribution's);
- ``dist:NAME=VERSION`` checks an installed distribution's version without importing it (for packages
  whose import needs a device at run time).

A version matches when it equals the wanted one or extends it with a local or dev part (``2.14.0+cu130``
matches ``2.14.0``). Exits 1 naming every mismatch, so a label can never claim a version that is not there.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import sys


def _matches(found: str, wanted: str) -> bool:
    return found == wanted or found.startswith((wanted + "+", wanted + ".dev", wanted + "rc"))


def _version_of(module_name: str) -> str | None:
    module = importlib.import_module(module_name)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    top = module_name.split(".")[0]
    for dist in metadata.packages_distributions().get(top, []):
        return metadata.version(dist)
    return None


def check(specs: list[str]) -> list[str]:
    problems = []
    for spec in specs:
        name, _, wanted = spec.partition("=")
        try:
            if name.startswith("dist:"):
                found = metadata.version(name[len("dist:"):])
            else:
                found = _version_of(name)
        except Exception as exc:  # noqa: BLE001 (report every failure, whatever it is)
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if wanted and (found is None or not _matches(found, wanted)):
            problems.append(f"{name}: wanted {wanted}, found {found}")
        else:
            print(f"ok  {name} {found or ''}".rstrip())
    return problems


if __name__ == "__main__":
    failures = check(sys.argv[1:])
    for line in failures:
        print(f"FAIL {line}", file=sys.stderr)
    sys.exit(1 if failures else 0)
