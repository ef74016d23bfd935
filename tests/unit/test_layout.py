"""The tools sit beside the services: the gateway package holds only the gateway service."""

import ast
from pathlib import Path

import gateway.client
import sdk
from tests.helpers import ROOT

TOOLS = ("cli", "sdk")
MAX_LINES = 320


def _imported(path: Path) -> set[str]:
    """Top-level packages a module imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_gateway_client_re_exports_the_sdk():
    assert gateway.client.Client is sdk.Client
    assert gateway.client.AsyncClient is sdk.AsyncClient
    assert gateway.client.GenerationError is sdk.GenerationError


def test_no_service_imports_the_tools():
    for package in ("gateway", "cache_service", "compute_service", "common"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "gateway" / "client.py":
                continue
            assert not _imported(path) & set(TOOLS), f"{path.relative_to(ROOT)} imports a tool package"


def test_no_service_imports_another_and_no_test_module_imports_another():
    services = {"gateway", "cache_service", "compute_service"}
    for package in services:
        for path in (ROOT / package).rglob("*.py"):
            others = _imported(path) & (services - {package})
            assert not others, f"{path.relative_to(ROOT)} imports {sorted(others)}: share it through common/"
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.split(".")[-1].startswith("test_"), (
                    f"{path.relative_to(ROOT)} imports {node.module}: move what it shares to a helper module"
                )


def test_no_service_source_file_is_long():
    """A service's files hold one concept each: none much over 300 lines (C++ kernels and headers too)."""
    long = {
        str(path.relative_to(ROOT)): lines
        for package in ("gateway", "cache_service", "compute_service", "common")
        for pattern in ("*.py", "*.cpp", "*.h")
        for path in (ROOT / package).rglob(pattern)
        if "_pb2" not in path.name and (lines := path.read_text().count("\n")) > MAX_LINES
    }
    assert not long, f"split these (over {MAX_LINES} lines): {long}"
