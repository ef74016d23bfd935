"""common.server.serve's start-up: what the process built before serving is frozen out of the collector."""

import gc

import structlog

from common.server import serve


def test_serve_freezes_what_start_up_built():
    gc.unfreeze()
    built = [object()]  # stands for a loaded model's objects
    assert any(obj is built for obj in gc.get_objects())
    server = serve([], "127.0.0.1", 0, structlog.get_logger())
    try:
        assert gc.get_freeze_count() > 0
        assert not any(obj is built for obj in gc.get_objects()), "a full collection would still walk it"
        after = [object()]  # built while serving: collected as usual
        assert any(obj is after for obj in gc.get_objects())
    finally:
        server.stop(0)
        gc.unfreeze()
