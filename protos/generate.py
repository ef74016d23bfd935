"""Regenerates the Python modules from the .proto files: python -m protos.generate [OUT_DIR]."""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))
SERVICE_PROTOS = ("protos/cache.proto", "protos/compute.proto", "protos/generation.proto")


def generate(out_dir: Path) -> None:
    include = protoc._get_resource_file_name("grpc_tools", "_proto")
    for proto in PROTOS:
        outputs = [f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
        if proto in SERVICE_PROTOS:
            outputs.append(f"--grpc_python_out={out_dir}")
        if protoc.main(["protoc", f"-I{ROOT}", f"-I{include}", *outputs, proto]) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
