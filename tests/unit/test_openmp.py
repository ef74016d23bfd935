"""Compute bounds its OpenMP workers' spin (compute_service/openmp.py) before torch loads the runtime, unless
its environment says otherwise."""

import subprocess
import sys

from compute_service import openmp
from tests.helpers import ROOT


def test_the_spin_is_bounded_unless_the_environment_sets_it_or_the_policy():
    environ = {}
    openmp.bound_spin(environ)
    assert environ == {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}
    for own in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        environ = dict(own)
        openmp.bound_spin(environ)
        assert environ == own, "a user's setting wins"


# `python -m compute_service` with its server module and transformers' modeling code stood in for: the
# stand-in notes GOMP_SPINCOUNT when each is imported (the real ones import torch, which loads the OpenMP
# runtime, which reads the variable).
PROBE = """
import importlib.abc, importlib.machinery, os, runpy, sys, types
seen = []
class StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in ("transformers.modeling_utils", "compute_service.server"):
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
        return types.ModuleType(spec.name)
    def exec_module(self, module):
        module.main = lambda: None
        seen.append(module.__name__)
sys.meta_path.insert(0, StandIn())
runpy.run_module("compute_service", run_name="__main__")
print(seen, "torch" in sys.modules)
"""


def test_compute_sets_it_before_it_imports_its_server_and_torch():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    imported = [openmp.SPIN_COUNT, "transformers.modeling_utils", openmp.SPIN_COUNT, "compute_service.server"]
    assert out.stdout.strip() == f"{imported} False"
