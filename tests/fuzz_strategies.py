"""Hypothesis strategies for hostile but valid protobuf messages of every RPC, derived from the descriptors.

`messages(descriptor, hints)` draws any message of that type: every field kind (ints at and past their
extremes and negatives, floats with NaN and infinities, strings huge or unicode, bytes, enums with unknown
values, repeated fields, maps, nested messages to a depth, oneofs, proto3 optional presence). `hints` maps a
field name (`name.key`, `name.value` for a map's) to a strategy of interesting values for it (or for each
of its elements), drawn about half of
the time instead of the generic one: values near a live pool's block range, a live epoch, sequence ids that
exist mixed with unknown ones. `Live` holds what is live in the services under test; `hints(live)` gives
the hints every RPC shares. `near_valid(base, live)` draws requests that pass most checks, so the deeper ones
are reached too: a valid request (`valid_forward`, `valid_reserve`, `valid_generate`, `valid_sampling`,
`valid_fork`, `valid_free`, `copies` of the live handle or CreatePool), mostly with a field or two made
hostile.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from protos import cache_pb2, compute_pb2, generation_pb2

F = FieldDescriptor
INT_BOUNDS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_DEPTH = 3
# Repeated fields: mostly a few entries, sometimes many (bounded: every example runs against real services).
MAX_REPEATED = 8
MAX_LONG_REPEATED = 300
MAX_HUGE_STRING = 100_000


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Any int in [low, high], biased to the extremes and to small values (and -1, 0, 1)."""
    edges = sorted({low, high, low + 1, high - 1} | {v for v in (-1, 0, 1, 2) if low <= v <= high})
    return st.one_of(
        st.sampled_from(edges), st.integers(max(low, -64), min(high, 64)), st.integers(low, high)
    )


def floats(width: int) -> st.SearchStrategy[float]:
    specials = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        float("nan"),
        float("inf"),
        float("-inf"),
        1e-45 if width == 32 else 5e-324,
    ]
    return st.one_of(st.sampled_from(specials), st.floats(width=width), st.floats(-4.0, 4.0, width=width))


def texts() -> st.SearchStrategy[str]:
    """Short, unicode (no surrogates: a Python str protobuf cannot encode), or huge."""
    unicode = st.characters(blacklist_categories=("Cs",))
    return st.one_of(
        st.text(max_size=12),
        st.text(unicode, max_size=64),
        st.integers(1_000, MAX_HUGE_STRING).map(lambda n: "x" * n),
    )


def scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.type in INT_BOUNDS:
        return integers(*INT_BOUNDS[field.type])
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return floats(32 if field.type == F.TYPE_FLOAT else 64)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_STRING:
        return texts()
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=256)
    if field.type == F.TYPE_ENUM:
        known = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(known), integers(-(2**31), 2**31 - 1))  # proto3 enums are open
    raise AssertionError(f"no strategy for {field.full_name} (type {field.type})")


def _hinted(name: str, generic: st.SearchStrategy, hints: Mapping) -> st.SearchStrategy:
    hint = hints.get(name)
    return generic if hint is None else st.one_of(hint, generic)


def _value(field: FieldDescriptor, hints: Mapping, depth: int) -> st.SearchStrategy:
    """One value of a singular field, or one element of a repeated one."""
    if field.type == F.TYPE_MESSAGE:
        return messages(field.message_type, hints, depth + 1)
    return _hinted(field.name, scalar(field), hints)


def _repeated(field: FieldDescriptor, hints: Mapping, depth: int) -> st.SearchStrategy:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        keys = _hinted(f"{field.name}.key", scalar(key), hints)
        values = _hinted(f"{field.name}.value", _value(value, {}, depth), hints)
        return st.dictionaries(keys, values, max_size=MAX_REPEATED)
    element = _value(field, hints, depth)
    longest = MAX_REPEATED if field.type == F.TYPE_MESSAGE else MAX_LONG_REPEATED
    return st.one_of(st.lists(element, max_size=MAX_REPEATED), st.lists(element, max_size=longest))


@st.composite
def _message(draw, descriptor: Descriptor, hints: Mapping, depth: int) -> Message:
    cls = _CLASSES[descriptor.full_name]
    fields = {}
    for oneof in descriptor.oneofs:
        if oneof.fields and not _synthetic(oneof):
            chosen = draw(st.sampled_from([None, *oneof.fields]))
            if chosen is not None:
                fields[chosen.name] = draw(_value(chosen, hints, depth))
    for field in descriptor.fields:
        if field.containing_oneof is not None and not _synthetic(field.containing_oneof):
            continue
        if field.is_repeated:
            fields[field.name] = draw(_repeated(field, hints, depth))
        elif field.type == F.TYPE_MESSAGE and depth >= MAX_DEPTH:
            continue
        elif draw(st.booleans()) or field.name in hints:
            fields[field.name] = draw(_value(field, hints, depth))
    return cls(**fields)


def _synthetic(oneof) -> bool:
    """A proto3 `optional` field's oneof: the field's presence, not a choice."""
    return len(oneof.fields) == 1 and oneof.name == f"_{oneof.fields[0].name}"


def messages(
    descriptor: Descriptor, hints: Mapping | None = None, depth: int = 0
) -> st.SearchStrategy[Message]:
    """Any message of this type, fields drawn as the module docstring says."""
    return _message(descriptor, hints or {}, depth)


_CLASSES: dict[str, type] = {}


def _register(module) -> None:
    def walk(descriptor: Descriptor, cls) -> None:
        _CLASSES[descriptor.full_name] = cls
        for nested in descriptor.nested_types:
            walk(nested, getattr(cls, nested.name))

    for name, descriptor in module.DESCRIPTOR.message_types_by_name.items():
        walk(descriptor, getattr(module, name))


for _module in (cache_pb2, compute_pb2, generation_pb2):
    _register(_module)
    for _dependency in _module.DESCRIPTOR.dependencies:
        if _dependency.name == "protos/common.proto":
            from protos import common_pb2 as _common

            _register(_common)


# what is live in the services under test, and the values it makes interesting
@dataclass(frozen=True)
class Live:
    num_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    epoch: str
    # Sequences that exist in `session_id` (and how many tokens each holds), and a live session.
    seqs: Mapping[str, int]
    session_id: str
    # The pool's handle, as CreatePool returned it.
    handle: Message


def hints(live: Live) -> dict[str, st.SearchStrategy]:
    """Interesting values per field name, for every message type (see the module docstring)."""
    blocks = st.one_of(st.integers(-2, live.num_blocks + 1), st.sampled_from([live.num_blocks - 1, -1]))
    tokens = st.one_of(st.integers(0, live.vocab_size - 1), st.sampled_from([-1, live.vocab_size]))
    lengths = st.one_of(
        st.integers(0, 2 * live.block_size + 1),
        st.sampled_from([live.max_model_len - 1, live.max_model_len, live.max_model_len + 1]),
        st.sampled_from([live.num_blocks * live.block_size, live.num_blocks * live.block_size + 1]),
    )
    seq_ids = st.one_of(
        st.sampled_from(sorted(live.seqs)), st.sampled_from(["fuzz-new", "fuzz-new-2", "", "a/1"])
    )
    return {
        "block_id": blocks,
        "block_tables": blocks,
        "first_block": blocks,
        "layer": st.integers(-1, 3),
        "token_ids": tokens,
        "history_token_ids": tokens,
        "suppress_token_ids": tokens,
        "stop_token_ids": tokens,
        "logit_bias.key": tokens,
        "num_computed.key": seq_ids,
        "num_computed.value": lengths,
        "num_tokens": lengths,
        "num_computed": lengths,
        "cu_seqlens_q": lengths,
        "max_tokens": st.integers(1, 4),
        "n": st.integers(1, 4),
        "seed": st.sampled_from([0, 2**64 - 1, 2**64 - 2, 2**63]),
        "seq_id": seq_ids,
        "seq_ids": seq_ids,
        "parent_id": seq_ids,
        "child_ids": seq_ids,
        "session_id": st.sampled_from([live.session_id, "", "fuzz-other"]),
        "pool_epoch": st.just(live.epoch),
        "epoch": st.just(live.epoch),
        "block_size": st.sampled_from([live.block_size, 1, 0, 1024, 1025]),
        "num_blocks": st.sampled_from([0, 1, live.num_blocks, 2**31, 2**62]),
        "memory_bytes": st.sampled_from([0, 1, 2**20, 2**62]),
        "kv_dtype": st.sampled_from(["float32", "bfloat16", "float16", "int8"]),
        "dtype": st.sampled_from(["float32", "bfloat16", ""]),
        "path": st.sampled_from(
            [live.handle.shm.path, "/dev/shm/pagedserve-kv-0-x", "/etc/passwd", "/dev/zero"]
        ),
        "shape": st.sampled_from(list(live.handle.shape)),
        "ttl_s": st.sampled_from([0.0, 1.0, 30.0]),
    }


@st.composite
def mutated(draw, base: st.SearchStrategy[Message], live: Live) -> Message:
    """A message of `base` with none, one or two of its fields replaced by those of a hostile message."""
    message = draw(base)
    hostile = draw(messages(message.DESCRIPTOR, hints(live)))
    for field in draw(st.lists(st.sampled_from(list(message.DESCRIPTOR.fields)), max_size=2)):
        message.ClearField(field.name)
        if field.is_repeated and field.message_type is not None and field.message_type.GetOptions().map_entry:
            getattr(message, field.name).MergeFrom(getattr(hostile, field.name))  # message values too
        elif field.is_repeated:
            getattr(message, field.name).extend(getattr(hostile, field.name))
        elif field.type == F.TYPE_MESSAGE:
            if hostile.HasField(field.name):
                getattr(message, field.name).CopyFrom(getattr(hostile, field.name))
        elif not field.has_presence or hostile.HasField(field.name):
            setattr(message, field.name, getattr(hostile, field.name))
    return message


def near_valid(base: st.SearchStrategy[Message], live: Live) -> st.SearchStrategy[Message]:
    """Requests that pass most checks: `base` (valid ones), mostly with a field or two made hostile."""
    return st.one_of(base, mutated(base, live))


@st.composite
def valid_steps(draw, live: Live) -> compute_pb2.StepsRequest:
    """A ForwardSteps first message: one new token per row, every row sampling, each row's steps within its
    table (of 3 blocks), a few stop ids, and half the time prompt-lookup drafts."""
    num_seqs, width = draw(st.integers(1, 4)), 3
    computed = [draw(st.integers(0, 2 * live.block_size)) for _ in range(num_seqs)]
    blocks = st.integers(0, live.num_blocks - 1)
    flat = draw(st.lists(blocks, min_size=num_seqs * width, max_size=num_seqs * width, unique=True))
    first = compute_pb2.ForwardRequest(
        pool_epoch=live.epoch,
        token_ids=[draw(st.integers(0, live.vocab_size - 1)) for _ in range(num_seqs)],
        cu_seqlens_q=range(num_seqs + 1),
        num_computed=computed,
        block_tables=flat,
        block_table_width=width,
        sample=[True] * num_seqs,
        sampling=[draw(valid_row_sampling(live)) for _ in range(num_seqs)],
    )
    room = [width * live.block_size - c for c in computed]
    request = compute_pb2.StepsRequest(
        first=first, max_steps=[draw(st.integers(1, min(8, r))) for r in room], cu_stop_token_ids=[0]
    )
    for _ in range(num_seqs):
        request.stop_token_ids.extend(draw(st.lists(st.integers(0, live.vocab_size - 1), max_size=3)))
        request.cu_stop_token_ids.append(len(request.stop_token_ids))
    if draw(st.booleans()):
        # prompt lookup: few distinct ids, so that runs recur and rows draft
        request.draft_tokens = draw(st.integers(1, 4))
        request.cu_lookup_token_ids.append(0)
        for _ in range(num_seqs):
            request.lookup_token_ids.extend(draw(st.lists(st.integers(0, 3), max_size=12)))
            request.cu_lookup_token_ids.append(len(request.lookup_token_ids))
    return request


@st.composite
def valid_forward(draw, live: Live) -> compute_pb2.ForwardRequest:
    """A Forward whose counts fit together, on the live epoch, its blocks in the pool (mostly distinct)."""
    num_seqs, width = draw(st.integers(1, 4)), 3
    new = [
        draw(st.lists(st.integers(0, live.vocab_size - 1), min_size=1, max_size=5)) for _ in range(num_seqs)
    ]
    computed = [draw(st.integers(0, 2 * live.block_size)) for _ in range(num_seqs)]
    assert 2 * live.block_size + 5 <= width * live.block_size, "every context fits its table"
    blocks = st.integers(0, live.num_blocks - 1)
    flat = draw(st.lists(blocks, min_size=num_seqs * width, max_size=num_seqs * width, unique=True))
    tables = [flat[i * width : (i + 1) * width] for i in range(num_seqs)]
    sample = [draw(st.booleans()) for _ in range(num_seqs)]
    rows = st.one_of(valid_row_sampling(live), messages(compute_pb2.RowSampling.DESCRIPTOR, hints(live)))
    sampling = [draw(rows) for _ in range(sum(sample))]
    request = compute_pb2.ForwardRequest(
        pool_epoch=live.epoch,
        token_ids=[t for tokens in new for t in tokens],
        cu_seqlens_q=[sum(len(tokens) for tokens in new[:i]) for i in range(num_seqs + 1)],
        num_computed=computed,
        block_tables=[b for table in tables for b in table],
        block_table_width=width,
        sample=sample,
        sampling=sampling,
    )
    if draw(st.booleans()):
        request.output_lens.extend(
            draw(st.lists(st.integers(0, 4), min_size=len(sampling), max_size=len(sampling)))
        )
    return request


@st.composite
def valid_reserve(draw, live: Live) -> cache_pb2.ReserveRequest:
    """A Reserve in the live session: new sequences and running live ones, lengths near the pool's limits."""
    h = hints(live)
    new = [
        cache_pb2.SequenceRequest(
            seq_id=draw(h["seq_id"]),
            num_tokens=draw(h["num_tokens"]),
            token_ids=draw(st.lists(h["token_ids"], max_size=2 * live.block_size + 1)),
            num_computed=draw(st.integers(-1, 2)),
            cache_salt=draw(st.sampled_from(["", "salt"])),
        )
        for _ in range(draw(st.integers(0, 3)))
    ]
    running = [
        cache_pb2.SequenceRequest(
            seq_id=seq_id, num_tokens=draw(h["num_tokens"]), num_computed=draw(h["num_computed"])
        )
        for seq_id in draw(st.lists(st.sampled_from(sorted(live.seqs)), max_size=2))
    ]
    return cache_pb2.ReserveRequest(new_seqs=new, running_seqs=running, session_id=draw(h["session_id"]))


def valid_row_sampling(live: Live) -> st.SearchStrategy[compute_pb2.RowSampling]:
    """Sampling rows compute accepts, at and near the ends of every range (so that steps run the model)."""
    unit = st.floats(0.0, 1.0, width=32)
    penalty = st.floats(-2.0, 2.0, width=32)
    return st.builds(
        compute_pb2.RowSampling,
        temperature=st.one_of(st.sampled_from([0.0, 1e-45, 3e38]), st.floats(0.0, 4.0, width=32)),
        top_p=unit.filter(lambda p: p > 0),
        top_k=st.one_of(st.integers(0, 8), st.just(2**31 - 1)),
        min_p=unit,
        seed=st.integers(0, 2**64 - 1),
        repetition_penalty=st.one_of(st.sampled_from([1e-45, 3e38]), st.floats(0.125, 4.0, width=32)),
        presence_penalty=penalty,
        frequency_penalty=penalty,
        logit_bias=st.dictionaries(st.integers(0, live.vocab_size - 1), st.floats(-100.0, 100.0, width=32)),
        logprobs=st.integers(0, 20),
    )


def valid_sampling(live: Live) -> st.SearchStrategy[generation_pb2.SamplingParams]:
    """Sampling controls in range, of a few tokens (seeds near 2**64 included)."""
    return st.builds(
        generation_pb2.SamplingParams,
        max_tokens=st.integers(1, 4),
        temperature=st.sampled_from([0.0, 0.7, 1.0]),
        top_k=st.integers(0, 8),
        seed=st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([2**64 - 1, 2**64 - 2])),
        n=st.integers(1, 4),
        min_tokens=st.integers(0, 1),
        logprobs=st.integers(0, 3),
        stop=st.lists(st.text(min_size=1, max_size=3), max_size=2),
        ignore_eos=st.booleans(),
        repetition_penalty=st.sampled_from([1.0, 1.5]),
        logit_bias=st.dictionaries(st.integers(0, live.vocab_size - 1), st.floats(-100.0, 100.0, width=32)),
    )


@st.composite
def valid_generate(draw, live: Live) -> generation_pb2.GenerateRequest:
    """A request of a few tokens on a prompt of token ids; its sampling controls in range, a field or two of
    them sometimes hostile."""
    prompt = draw(st.lists(st.integers(0, live.vocab_size - 1), min_size=1, max_size=40))
    return generation_pb2.GenerateRequest(
        token_ids=prompt,
        sampling=draw(near_valid(valid_sampling(live), live)),
        priority=draw(st.integers(-2, 2)),
    )


@st.composite
def valid_embed(draw, live: Live) -> generation_pb2.EmbedRequest:
    """A few inputs of token ids within the vocabulary; dimensions sometimes set (the full width or not)."""
    tokens = st.lists(st.integers(0, live.vocab_size - 1), min_size=1, max_size=40)
    request = generation_pb2.EmbedRequest(
        inputs=[
            generation_pb2.EmbedInput(token_ids=ids) for ids in draw(st.lists(tokens, min_size=1, max_size=4))
        ],
        priority=draw(st.integers(-2, 2)),
    )
    if draw(st.booleans()):
        request.dimensions = draw(st.integers(-1, 80))
    return request


def copies(message: Message) -> st.SearchStrategy[Message]:
    """A fresh copy of `message` per draw (a base to mutate: the live pool's handle, its CreatePool)."""

    def copy() -> Message:
        clone = type(message)()
        clone.CopyFrom(message)
        return clone

    return st.builds(copy)


@st.composite
def valid_fork(draw, live: Live) -> cache_pb2.ForkRequest:
    children = draw(st.lists(st.sampled_from(["fuzz-child-1", "fuzz-child-2", "fuzz-child-3"]), max_size=3))
    return cache_pb2.ForkRequest(
        parent_id=draw(st.sampled_from(sorted(live.seqs))), child_ids=children, session_id=live.session_id
    )


@st.composite
def valid_free(draw, live: Live) -> cache_pb2.FreeRequest:
    seq_ids = draw(st.lists(st.sampled_from(sorted(live.seqs)), max_size=2, unique=True))
    computed = {seq_id: draw(st.integers(0, live.seqs[seq_id])) for seq_id in seq_ids if draw(st.booleans())}
    return cache_pb2.FreeRequest(seq_ids=seq_ids, num_computed=computed, session_id=live.session_id)
