"""Local files pinned by what the kernel keeps about them (`checkpoint/local_pin.py`): the same pin means no file
was written or replaced since."""

from __future__ import annotations

import os
import time

from layerwise_cli.checkpoint.local_pin import RACY_S, files_pin


def _files(tmp_path):
    paths = [tmp_path / "a.safetensors", tmp_path / "b.json"]
    for i, path in enumerate(paths):
        path.write_bytes(bytes([i]) * 64)
    return paths


def test_the_same_files_give_the_same_pin_in_any_order(tmp_path):
    paths = _files(tmp_path)
    pin = files_pin(paths)
    assert pin is not None and pin.startswith("files:") and files_pin(reversed(paths)) == pin


def test_a_rewrite_in_place_with_the_same_size_and_times_set_back_moves_the_pin(tmp_path):
    """The writer can set the modification time back, not the change time the kernel stamps."""
    paths = _files(tmp_path)
    pin = files_pin(paths)
    before = os.stat(paths[0])
    time.sleep(0.05)
    paths[0].write_bytes(b"\xff" * 64)
    os.utime(paths[0], ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(paths[0])
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert files_pin(paths) != pin


def test_a_file_replaced_by_a_rename_moves_the_pin(tmp_path):
    paths = _files(tmp_path)
    pin = files_pin(paths)
    other = tmp_path / "new"
    other.write_bytes(paths[0].read_bytes())
    os.replace(other, paths[0])
    assert files_pin(paths) != pin


def test_a_missing_file_is_no_pin(tmp_path):
    paths = _files(tmp_path)
    paths[1].unlink()
    assert files_pin(paths) is None


def test_a_file_changed_after_the_work_began_or_just_before_it_is_no_pin(tmp_path):
    paths = _files(tmp_path)
    began = time.time()
    assert files_pin(paths, unchanged_since=began) is None  # written just now: within one clock tick of it
    assert files_pin(paths, unchanged_since=began + 2 * RACY_S) == files_pin(paths)
    time.sleep(2 * RACY_S)
    began = time.time()
    paths[1].write_bytes(b"x" * 64)  # while the work ran
    assert files_pin(paths, unchanged_since=began) is None
