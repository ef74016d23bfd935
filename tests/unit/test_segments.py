"""Removing the segments of a cache that died: only that owner's, by the pid in their names."""

from common import shm_files


def test_remove_segments_of_removes_only_that_owners(tmp_path):
    names = ["pagedserve-kv-123-aa", "pagedserve-kv-123-bb", "pagedserve-kv-1234-cc", "other-123-dd"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = shm_files.remove_segments_of(123, tmp_path)
    assert removed == [tmp_path / "pagedserve-kv-123-aa", tmp_path / "pagedserve-kv-123-bb"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-123-dd", "pagedserve-kv-1234-cc"]
    assert shm_files.remove_segments_of(123, tmp_path) == []
