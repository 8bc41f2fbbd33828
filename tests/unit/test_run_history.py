"""The run's metrics history in one append-only file: checkpoints keep a mark, a resume cuts the file back to it."""

from __future__ import annotations

import json

import pytest

from vime_engine.checkpoint import store as ckpt
from vime_engine.checkpoint.run_history import (
    HISTORY_FILE, MARK_KEY, HistoryError, HistoryMark, RunHistory, encode, read_checked, saved_records,
)


def _record(rollout_id: int) -> dict:
    # About the size of a real rollout's metrics (~0.8 KB).
    return {"rollout_id": rollout_id, **{f"train/metric_{i:02d}": rollout_id + i / 7 for i in range(30)}}


def _save(root, history: RunHistory, rollout_id: int) -> ckpt.CheckpointRef:
    """What RunContext.save does with the history: persist it, then commit a checkpoint carrying the mark."""
    staged = ckpt.staging_dir(root, rollout_id)
    (staged / "buffer.pkl").write_bytes(b"carry")
    state = {"rollout_id": rollout_id, MARK_KEY: history.persist().to_json()}
    return ckpt.commit(root, staged, rollout_id, state, keep_last=2)


def _run(root, rollouts: range, history: RunHistory, save_every: int = 10) -> list[ckpt.CheckpointRef]:
    refs = []
    for rollout_id in rollouts:
        history.append(_record(rollout_id))
        if (rollout_id + 1) % save_every == 0:
            refs.append(_save(root, history, rollout_id))
    return refs


def test_driver_json_does_not_grow_with_the_run_and_memory_holds_only_unsaved_records(tmp_path):
    history = RunHistory.start(tmp_path)
    refs = _run(tmp_path, range(300), history)
    sizes = {(ref.path / ckpt.DRIVER_STATE).stat().st_size for ref in refs[-2:]}  # keep_last 2
    first = refs[0].manifest.files[ckpt.DRIVER_STATE].size
    assert max(sizes) - first <= 8, (first, sizes)  # only the digits of the counts grow
    assert history.pending == []
    assert len((tmp_path / HISTORY_FILE).read_bytes().splitlines()) == 300
    assert HISTORY_FILE not in refs[-1].manifest.files  # the growing file is no part of any manifest
    assert list(history) == [_record(r) for r in range(300)]


def test_resume_cuts_the_file_at_the_checkpoints_mark_and_drops_a_torn_tail(tmp_path):
    history = RunHistory.start(tmp_path)
    _run(tmp_path, range(20), history)
    # A later save appended rollouts 20..24 and was killed mid-append, before its manifest.
    history.pending = [_record(r) for r in range(20, 25)]
    history.persist()
    with open(tmp_path / HISTORY_FILE, "ab") as f:
        f.write(b'{"rollout_id": 25, "train/')

    found = ckpt.find_latest(tmp_path)
    assert found.rollout_id == 19
    mark = HistoryMark.from_json(found.driver_state()[MARK_KEY])
    resumed = RunHistory.start(tmp_path, read_checked(tmp_path / HISTORY_FILE, mark))
    assert resumed.mark == mark and resumed.mark.lines == 20
    assert (tmp_path / HISTORY_FILE).stat().st_size == mark.bytes
    assert list(resumed) == [_record(r) for r in range(20)]

    _run(tmp_path, range(20, 30), resumed)  # continues: the older checkpoint still reads its own prefix
    older = ckpt.validate(ckpt.checkpoint_dir(tmp_path, 19))
    newest = ckpt.find_latest(tmp_path)
    path = tmp_path / HISTORY_FILE
    assert saved_records(older.driver_state(), path.read_bytes, str(path)) == [_record(r) for r in range(20)]
    assert saved_records(newest.driver_state(), path.read_bytes, str(path)) == [_record(r) for r in range(30)]


def test_a_changed_or_missing_file_is_refused_naming_it(tmp_path):
    history = RunHistory.start(tmp_path)
    _run(tmp_path, range(10), history)
    mark = HistoryMark.from_json(ckpt.find_latest(tmp_path).driver_state()[MARK_KEY])
    path = tmp_path / HISTORY_FILE
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(HistoryError, match=f"{HISTORY_FILE}.*changed after the save"):
        read_checked(path, mark)
    path.write_bytes(bytes(data[: mark.bytes // 2]))
    with pytest.raises(HistoryError, match="the file was cut or replaced"):
        read_checked(path, mark)
    path.unlink()
    with pytest.raises(HistoryError, match="missing"):
        read_checked(path, mark)


def test_a_checkpoint_of_the_old_layout_resumes_with_its_list(tmp_path):
    """driver.json written before the history file existed holds the whole history: it becomes the file."""
    old = [_record(r) for r in range(3)]
    (tmp_path / HISTORY_FILE).write_text("stale\n" * 7)
    no_file = lambda: pytest.fail("an old checkpoint has no history file")  # noqa: E731
    assert saved_records({"history": old}, no_file, HISTORY_FILE) == old
    resumed = RunHistory.start(tmp_path, old)
    assert resumed.mark.lines == 3 and list(resumed) == old
    resumed.append(_record(3))
    mark = resumed.persist()
    assert [json.loads(line) for line in read_checked(tmp_path / HISTORY_FILE, mark).splitlines()] == old + [
        _record(3)]


def test_a_fresh_run_makes_no_history_file_until_its_first_save(tmp_path):
    # a run that fails after Ray started left an empty history.jsonl in --save (and so the lock file, too)
    (tmp_path / HISTORY_FILE).write_bytes(encode(_record(7)))  # an earlier run's, which saved no checkpoint
    history = RunHistory.start(tmp_path)
    assert not (tmp_path / HISTORY_FILE).exists() and list(history) == []
    history.append(_record(0))
    ref = _save(tmp_path, history, 0)
    assert [json.loads(line) for line in (tmp_path / HISTORY_FILE).read_text().splitlines()] == [_record(0)]
    assert saved_records(ckpt.validate(ref.path).driver_state(), (tmp_path / HISTORY_FILE).read_bytes,
                         "history") == [_record(0)]


def test_without_a_checkpoint_directory_the_history_stays_in_memory():
    history = RunHistory.start(None, [_record(0)])
    history.append(_record(1))
    assert list(history) == [_record(0), _record(1)]
    with pytest.raises(HistoryError, match="no history file"):
        history.persist()


def test_the_history_travels_with_checkpoints_committed_to_storage_and_fetched_elsewhere(tmp_path):
    """Committed like train_chunk commits a chunk's end checkpoint; fetched like the next chunk on another machine."""
    from tasks.engine_job.checkpoint_history import fetch_history, open_checkpoint, read_history, upload_history
    from tasks.storage import open_storage

    local = tmp_path / "machine-a"
    history = RunHistory.start(local)
    root = open_storage((tmp_path / "bucket").as_uri())
    refs = _run(local, range(20), history)
    for ref in refs:  # rollout 9, then 19
        key = f"runs/r/checkpoints/{ref.path.name}"
        upload_history(root, key, ref)
        root.commit_tree(ref.path, key)
    upload_history(root, "runs/r/checkpoints/rollout_0000009", refs[0])  # again: never cuts what 19 needs
    assert read_history(root.uri("runs/r/checkpoints/rollout_0000019")) == [_record(r) for r in range(20)]
    assert read_history(root.uri("runs/r/checkpoints/rollout_0000009")) == [_record(r) for r in range(10)]

    other = tmp_path / "machine-b"
    storage, key = open_checkpoint(root.uri("runs/r/checkpoints/rollout_0000019"))
    storage.fetch_tree(key, ckpt.checkpoint_dir(other, 19))
    fetch_history(storage, key, other)
    found = ckpt.find_latest(other)
    resumed = RunHistory.start(other, read_checked(other / HISTORY_FILE,
                                                   HistoryMark.from_json(found.driver_state()[MARK_KEY])))
    assert list(resumed) == [_record(r) for r in range(20)]
