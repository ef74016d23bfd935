"""The compute service's flags, for `python -m compute_service` and `pagedserve up`."""

import argparse

from common.options import ServiceOptions, add_dtype, add_kv_dtype, add_logging, add_model
from common.transport import add_listen
from compute_service.attention.registry import BACKENDS


def add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attention-backend",
        choices=list(BACKENDS),
        default=None,
        help="paged-attention function (default: cpu-native for float32 where its kernel builds, else cpu)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--plain-linear",
        action="store_true",
        help="keep nn.Linear as is (default: float32 CPU decode batches multiply W by x transposed, faster)",
    )


OPTIONS = ServiceOptions(
    "compute_service",
    50053,
    settings=(add_model, add_dtype, add_kv_dtype, add_settings, add_logging),
    wiring=(add_listen,),
)
