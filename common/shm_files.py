"""The files a cache service creates in /dev/shm, pool segments (common/shared_pool.py), session fences
(common/session_fence.py) and image stores (common/image_segment.py): their names, which carry the owner's
pid, and removing those an owner left.

NOTE: no torch here: `pagedserve up`'s launcher removes what a cache killed with -9 left, and imports no
torch."""

import os
from pathlib import Path

SHM_DIR = Path(os.environ.get("PAGEDSERVE_SHM_DIR", "/dev/shm"))
SEGMENT_PREFIX = "pagedserve-kv-"
# The pool's session fence (common/session_fence.py), a file of its own whatever the pool's device.
FENCE_PREFIX = "pagedserve-fence-"
# The pool's image store (common/image_segment.py), a vision-language model's embeddings.
IMAGES_PREFIX = "pagedserve-images-"
PREFIXES = (SEGMENT_PREFIX, FENCE_PREFIX, IMAGES_PREFIX)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Removes segments (and session fences) left by owners that died without unlinking them."""
    removed = []
    for prefix in PREFIXES:
        for path in shm_dir.glob(f"{prefix}*"):
            owner = path.name.removeprefix(prefix).split("-", 1)[0]
            if owner.isdigit() and not _pid_alive(int(owner)):
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def files_of(pid: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """The segments and session fences that process pid created and that are still there, sorted."""
    return sorted(path for prefix in PREFIXES for path in shm_dir.glob(f"{prefix}{pid}-*"))


def remove_segments_of(pid: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Removes the segments (and session fences) that process pid created; for whoever sees that owner
    exit."""
    assert pid != os.getpid(), "an owner releases its own segments"
    removed = files_of(pid, shm_dir)
    for path in removed:
        path.unlink(missing_ok=True)
    return removed
