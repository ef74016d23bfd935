"""What compute's process imports before it serves: transformers' modeling code, with scipy hidden from it.

transformers decides once, when it first asks, whether scipy is installed; with it there, the base class of
every model (transformers.modeling_utils, through its loss functions) imports the detection models' losses,
and those import scipy.optimize and scipy.linalg: about 380 modules and 1.3 s of CPU at every compute start
(measured on a 2-vCPU AMD EPYC), none of them used by an architecture compute serves
(compute_service/architectures.py). `python -m compute_service` imports transformers' modeling code here
first, scipy reported missing meanwhile; scipy itself imports as before afterwards.
tests/e2e/test_compute_service.py checks that the running service maps no scipy library.
"""

import importlib
import sys

# Packages transformers is told are missing while its modeling code loads.
HIDDEN = ("scipy",)
MODELING = "transformers.modeling_utils"


def import_modeling() -> None:
    """Imports transformers' modeling code with HIDDEN's packages reported missing (importlib.util.find_spec
    gives None for them), unless transformers' modeling code or one of those packages is already loaded."""
    if MODELING in sys.modules or any(name in sys.modules for name in HIDDEN):
        return
    for name in HIDDEN:
        sys.modules[name] = None
    try:
        importlib.import_module(MODELING)
    finally:
        for name in HIDDEN:
            del sys.modules[name]
