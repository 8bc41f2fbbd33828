"""A YAML config file's flat flag values; a key given twice, bad syntax or a non-mapping is a ConfigError naming the
file and, where it has one, the line."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from vime_engine.config.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last
    value silently, so a config edited in two places would train with whichever came later)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be repeated by design
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the base constructor reports unhashable keys itself
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first_line[key] + 1}); keep one of them",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The flat flag values of a YAML file; every problem is a ConfigError naming the file and, for syntax
    errors and duplicate keys, the line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_error_message(path, exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, found {type(data).__name__}")
    not_names = [k for k in data if not isinstance(k, str)]
    if not_names:
        raise ConfigError(
            f"--config {path}: {not_names[0]!r} is not a flag name; keys are names like rollout-batch-size"
        )
    return data


def _yaml_error_message(path: Path, exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"--config {path}, line {mark.line + 1}, column {mark.column + 1}" if mark else f"--config {path}"
    problem = exc.problem or exc.context or "not valid YAML"
    if exc.problem and exc.context and exc.context_mark and exc.context_mark.line != mark.line:
        problem += f" ({exc.context} that starts on line {exc.context_mark.line + 1}: close it there)"
    lines = path.read_text(encoding="utf-8").splitlines()
    line = lines[mark.line] if mark and mark.line < len(lines) else ""
    hint = "; YAML indents with spaces, never tabs: replace the tab with spaces" if "\t" in line else ""
    return f"{where}: {problem}{hint}"
