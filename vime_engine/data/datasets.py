"""Reading prompt datasets (`.jsonl`, `.parquet`) into `PromptRecord`s, with row-exact errors.

Shapes met in practice, all read by choosing the keys (vime's `--input-key` / `--label-key` /
`--metadata-key`):
- dapo-math-17k: `prompt` is a list of chat messages, `label` the answer;
- gsm8k: `question`, and `answer` ending in a `#### N` line: the label becomes N;
- aime-2024: `prompt` (text or messages) or `problem`, and `label` or `answer` (text or integer).
A key may also be a dotted path into a nested object (`reward_model.ground_truth`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vime_engine.data.records import ChatMessage, Prompt, PromptRecord

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")

_GSM8K_FINAL = re.compile(r"^\s*####\s*(.+?)\s*$", re.MULTILINE)


class DatasetError(ValueError):
    """A dataset file that cannot be read as prompts; the message names file, row and key."""


def load_prompt_dataset(
    path: str | Path,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str | None = None,
) -> list[PromptRecord]:
    """Read every row of `path` into a `PromptRecord`, in file order.

    Rows are numbered from 1 (for `.jsonl`, the line number, blank lines skipped but counted).
    Any problem is a `DatasetError` naming the file, the row, the key and what was found.
    """
    path = Path(path)
    rows = _read_rows(path)
    records = [_to_record(path, row_number, row, input_key, label_key, metadata_key) for row_number, row in rows]
    if not records:
        raise DatasetError(f"{path}: the dataset has no rows")
    return records


def _read_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    if path.suffix not in SUPPORTED_EXTENSIONS:
        raise DatasetError(
            f"{path}: unsupported file extension {path.suffix!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    return _read_parquet(path)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{path}: not UTF-8 text ({exc})") from exc
    rows = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}, row {line_number}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(row, dict):
            raise DatasetError(f"{path}, row {line_number}: expected a JSON object, found {type(row).__name__}")
        rows.append((line_number, row))
    return iter(rows)


def _read_parquet(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: cannot read as parquet ({exc})") from exc
    return enumerate(table.to_pylist(), start=1)


def _to_record(
    path: Path, row_number: int, row: dict[str, Any], input_key: str, label_key: str, metadata_key: str | None
) -> PromptRecord:
    where = f"{path}, row {row_number}"
    prompt = _prompt(where, input_key, _lookup(where, row, input_key, "--input-key"))
    label = _label(where, label_key, _lookup(where, row, label_key, "--label-key"))
    metadata = {}
    if metadata_key is not None:
        metadata = _metadata(where, metadata_key, _lookup(where, row, metadata_key, "--metadata-key"))
    return PromptRecord(prompt=prompt, label=label, metadata=metadata)


def _lookup(where: str, row: dict[str, Any], key: str, flag: str) -> Any:
    """`row[key]`, or the value at a dotted path; null counts as missing, since parquet files
    store a key absent from some rows as null."""
    value: Any = row.get(key)
    if value is None and "." in key:
        value = row
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        present = ", ".join(str(k) for k, v in row.items() if v is not None)
        raise DatasetError(f"{where}: no key {key!r} (keys found: {present}); set {flag}")
    return value


def _prompt(where: str, key: str, value: Any) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}, key {key!r}: the prompt is empty")
        return value
    if isinstance(value, list) and value:
        return [_message(where, key, i, m) for i, m in enumerate(value)]
    raise DatasetError(
        f"{where}, key {key!r}: expected a prompt string or a non-empty list of "
        f'{{"role", "content"}} messages, found {_describe(value)}'
    )


def _message(where: str, key: str, index: int, message: Any) -> ChatMessage:
    if (
        not isinstance(message, dict)
        or not isinstance(message.get("role"), str)
        or not isinstance(message.get("content"), str)
    ):
        raise DatasetError(
            f'{where}, key {key!r}, message {index}: expected {{"role": str, "content": str}}, '
            f"found {_describe(message)}"
        )
    return {"role": message["role"], "content": message["content"]}


def _label(where: str, key: str, value: Any) -> str:
    """The label as text: strings as given (a gsm8k solution reduced to its `#### N`), integers
    and integral floats as decimal integers."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}, key {key!r}: expected the label as a string or a number, found {_describe(value)}")
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    final = _GSM8K_FINAL.findall(value)
    return final[-1] if final else value.strip()


def _metadata(where: str, key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise DatasetError(f"{where}, key {key!r}: expected metadata as an object (or its JSON text), found {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"
