"""Reading prompt datasets (`.jsonl`, `.parquet`) into `PromptRecord`s, with row-exact errors.

Shapes met in practice, all read by choosing the keys (vime's `--input-key` / `--label-key` /
`--metadata-key`):
- dapo-math-17k: `prompt` is a list of chat messages, `label` the answer;
- gsm8k: `question`, and `answer` ending in a `#### N` line: the label becomes N;
- aime-2024: `prompt` (text or messages) or `problem`, and `label` or `answer` (text or integer).
A key may also be a dotted path into a nested object (`reward_model.ground_truth`).
A path may end in a row slice as in vime/slime: `data.jsonl@[0:1000]` reads the first 1000 rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from vime_engine.data.records import ChatMessage, Prompt, PromptRecord

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")

_GSM8K_FINAL = re.compile(r"^\s*####\s*(.+?)\s*$", re.MULTILINE)
# vime/slime's row slice: `data.jsonl@[0:1000]` reads rows 0..999 (Python slice semantics, bounds optional).
_ROW_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<bounds>[^\]]*)\]$")


class DatasetError(ValueError):
    """A dataset file that cannot be read as prompts; the message names file, row and key."""


class NumberedRecord(NamedTuple):
    row: int  # the row's number in its file, from 1 (for .jsonl the line number)
    record: PromptRecord


def load_prompt_dataset(
    path: str | Path,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str | None = None,
) -> list[PromptRecord]:
    """Read every row of `path` (or of its row slice `path@[a:b]`) into a `PromptRecord`, in file order.

    Rows are numbered from 1 (for `.jsonl`, the line number, blank lines skipped but counted).
    Any problem is a `DatasetError` naming the file, the row, the key and what was found.
    """
    return [n.record for n in read_prompt_rows(path, input_key, label_key, metadata_key)]


def read_prompt_rows(
    path: str | Path,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str | None = None,
    flag_prefix: str = "--",
) -> list[NumberedRecord]:
    """`load_prompt_dataset` with each record's row number, for messages about a row found later.
    `flag_prefix` names the key flags in messages: `--eval-` for an eval set (`--eval-input-key`)."""
    file, rows_slice = split_row_slice(str(path))
    rows = list(_read_rows(file))
    selected = rows[rows_slice] if rows_slice is not None else rows
    if not selected:
        if rows:
            raise DatasetError(f"{path}: the slice selects none of the file's {len(rows)} rows")
        raise DatasetError(f"{file}: the dataset has no rows; write one JSON object per line")
    return [
        NumberedRecord(number, _to_record(file, number, row, input_key, label_key, metadata_key, flag_prefix))
        for number, row in selected
    ]


def split_row_slice(spec: str) -> tuple[Path, slice | None]:
    """`data.jsonl@[a:b]` → (Path("data.jsonl"), slice(a, b)); a plain path → (Path(spec), None)."""
    m = _ROW_SLICE.match(spec)
    if m is None:
        return Path(spec), None
    bounds = m.group("bounds").split(":")
    if len(bounds) != 2 or not all(re.fullmatch(r"\s*(-?\d+)?\s*", b) for b in bounds):
        raise DatasetError(
            f"{spec}: a row slice is @[START:END] with integers (either may be left out), e.g. "
            f"{m.group('path')}@[0:1000]"
        )
    start, stop = (int(b) if b.strip() else None for b in bounds)
    return Path(m.group("path")), slice(start, stop)


def _read_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    if path.suffix not in SUPPORTED_EXTENSIONS:
        raise DatasetError(
            f"{path}: unsupported file extension {path.suffix!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if not path.is_file():
        raise DatasetError(f"{path}: " + ("a directory, not a dataset file" if path.is_dir() else "no such file"))
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    return _read_parquet(path)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    rows = []
    for line_number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            # utf-8-sig on the first line: a byte-order mark some editors write is not part of the JSON
            line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise DatasetError(
                f"{path}, row {line_number}: not UTF-8 text (byte {exc.start + 1} of the line is "
                f"0x{raw[exc.start]:02x}); convert the file to UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"{path}, row {line_number}: not valid JSON ({exc.msg} at column {exc.colno}, near "
                f"{_near(line, exc.pos)}); each row must be one JSON object on one line"
            ) from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}, row {line_number}: expected a JSON object, found {type(row).__name__}")
        rows.append((line_number, row))
    return iter(rows)


def _near(line: str, pos: int) -> str:
    """The text around a parse error, the error's position marked with `⟨here⟩`."""
    before, after = line[max(0, pos - 24):pos], line[pos:pos + 16].rstrip("\r\n")
    return f"{'…' if pos > 24 else ''}{before}⟨here⟩{after}{'…' if pos + 16 < len(line.rstrip()) else ''}"


def _read_parquet(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: cannot read as parquet ({exc})") from exc
    return enumerate(table.to_pylist(), start=1)


def _to_record(
    path: Path, row_number: int, row: dict[str, Any], input_key: str, label_key: str, metadata_key: str | None,
    flag_prefix: str = "--",
) -> PromptRecord:
    where = f"{path}, row {row_number}"
    prompt = _prompt(where, input_key, _lookup(where, row, input_key, f"{flag_prefix}input-key"))
    label = _label(where, label_key, _lookup(where, row, label_key, f"{flag_prefix}label-key"))
    metadata = {}
    if metadata_key is not None:
        metadata = _metadata(where, metadata_key, _lookup(where, row, metadata_key, f"{flag_prefix}metadata-key"))
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
    """The row's prompt; an empty one (or an empty user message in a conversation) is refused, since the model
    would be trained on answers to nothing (vime reads such rows in silence)."""
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}, key {key!r}: the prompt is empty; write it or drop the row")
        return value
    if isinstance(value, list) and value:
        messages = [_message(where, key, i, m) for i, m in enumerate(value)]
        empty = next((i for i, m in enumerate(messages) if m["role"] == "user" and not m["content"].strip()), None)
        if empty is not None:
            raise DatasetError(f"{where}, key {key!r}, message {empty}: the user message is empty; write it or drop "
                               "the row")
        return messages
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
    label = final[-1] if final else value.strip()
    if not label:
        raise DatasetError(f"{where}, key {key!r}: the label is empty; every prompt needs the reference answer "
                           "its responses are graded against: fill it in or drop the row")
    return label


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
