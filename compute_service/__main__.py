import os

from compute_service.lean_imports import import_modeling
from compute_service.openmp import bound_spin

# NOTE: before anything imports torch, which loads the OpenMP runtime that reads it.
bound_spin(os.environ)
# NOTE: before anything imports transformers, which decides then which optional packages it loads.
import_modeling()

from compute_service.server import main  # noqa: E402

main()
