import os
import sys

from compute_service import standby
from compute_service.lean_imports import import_modeling
from compute_service.openmp import bound_spin

# NOTE: before the imports (seconds): a standby whose lifeline ends meanwhile stops at once; it holds the
# cache's lifeline, which would wait for it. And its load runs at the standby's lower priority, the threads
# torch starts included.
if standby.FLAG in sys.argv[1:]:
    standby.yield_cpu()
    standby.stop_with_lifeline()

# NOTE: before anything imports torch, which loads the OpenMP runtime that reads it.
bound_spin(os.environ)
# NOTE: before anything imports transformers, which decides then which optional packages it loads.
import_modeling()

from compute_service.server import main  # noqa: E402

main()
