"""A request's block-sparse decode (GenerateRequest.sparse_attention, docs/sparse-attention.md) against what
the attached compute enables (ModelInfo.sparse_attention): the settings its rows carry in every step
(ForwardRequest.sparse), or a refusal saying how to enable it."""

from common.errors import InvalidArgument
from common.sparse_settings import FIELDS, SparseAttention, check
from protos import compute_pb2, generation_pb2

# A row's ForwardRequest.sparse entry: (sink, recent, topk), topk 0 dense.
Row = tuple[int, int, int]
DENSE: Row = (0, 0, 0)


def resolve(request: generation_pb2.GenerateRequest, info: compute_pb2.ModelInfo) -> Row | None:
    """The request's row settings; None where compute has no block-sparse decode (its rows say nothing).
    InvalidArgument for a request asking for it there, or with settings that cannot run."""
    support = info.sparse_attention
    asked = request.sparse_attention if request.HasField("sparse_attention") else None
    given = {}
    if asked is not None:
        given = {name: getattr(asked, name) for name in FIELDS if asked.HasField(name)}
    if asked is not None and not asked.enabled and given:
        raise InvalidArgument(
            f"sparse_attention sets {', '.join(given)} with enabled false: the settings apply to block-sparse"
            " decode only; set enabled true, or send enabled false alone for dense decode"
        )
    if not support.enabled:
        if asked is not None and asked.enabled:
            raise InvalidArgument(_not_enabled(info.attention_backend))
        return None
    wanted = support.default_sparse if asked is None else asked.enabled
    if not wanted:
        return DENSE
    default = support.settings
    settings = SparseAttention(**{name: getattr(default, name) for name in FIELDS} | given)
    try:
        check(settings, "sparse_attention")
    except ValueError as err:
        raise InvalidArgument(str(err)) from err
    return settings.sink, settings.recent, settings.topk


def _not_enabled(backend: str) -> str:
    how = "start compute with --sparse-attention allow (or on)"
    if backend != "cpu-native":
        how += f" and --attention-backend cpu-native (this stack's attention backend is {backend})"
    return (
        f"sparse_attention: this stack decodes densely only: {how} to let requests ask for block-sparse "
        "decode, or leave sparse_attention unset"
    )
