"""The committed generated modules are exactly what the .proto files produce."""

from pathlib import Path

from protos.generate import ROOT, generate


def test_regenerating_reproduces_the_committed_modules(tmp_path: Path):
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "protos").glob("*_pb2*.py*"))
    assert generated == committed
    for path in generated:
        assert (tmp_path / path).read_bytes() == (ROOT / path).read_bytes(), f"{path} is stale: make protos"
