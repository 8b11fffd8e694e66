"""The control protocol between a client (an engine) and the KV cache server.

Every message is one msgpack frame of a msgspec struct; requests are a tagged union on the
field `op`, and every request gets exactly one reply carrying the same `req_id`: its result, or
an `ErrorReply` (code + message). Page bytes never travel here: the engine hands its KV cache
buffers to the server once, as sealed memfd file descriptors over a Unix domain socket (the
`register` request, docs/cache_server_security.md), and then sends block ids; the server copies
pages.

Trust: `auth` (every request) is the server's shared secret when it was started with one; `token`
(every request on a registration) is the secret the `register` reply returned, so no other client
can act on a registration; lookup ids are random 63-bit numbers, so only their holder can
retrieve or release them.

Layout of the registered buffers (the planner's layout, docs/design.md §3):

    buffers[j]        one shared-memory segment per layer slot j (layer j of every group)
    block b, group g  page of layer j of g = buffers[j][b * stride_j : b * stride_j + page_j]
                      stride_j = buffers[j].page_stride_bytes, or the layout's page_stride_bytes when 0
                      page_j   = g.layer_page_bytes[j] for a group of mixed pages, else g.page_bytes
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

import msgspec
import xxhash

AUTH_TOKEN_ENV = "HYBRIDKV_AUTH_TOKEN"  # the server's shared secret, for the server and every client
AUTH_TOKEN_FILE_ENV = "HYBRIDKV_AUTH_TOKEN_FILE"  # ... or a file holding it
FORMAT_VERSION = 1  # of object keys and object bytes; bump on any change to either


class GroupKind(Enum):
    """What an engine group caches; decides its object group and its hit rule."""

    FULL = "full"  # every block of the prefix is needed
    SLIDING = "sliding"  # the last window_tokens - 1 tokens are needed
    CHUNKED = "chunked"  # the blocks of the current attention chunk (window_tokens = its size)
    STATE = "state"  # a recurrent state: only the block at the hit boundary (opaque bytes)
    CROSS = "cross"  # never prefix-cached: not stored and never gates a lookup


class ErrorCode(Enum):
    BAD_MESSAGE = "bad_message"  # not msgpack, a missing or ill-typed field
    UNKNOWN_OP = "unknown_op"
    TOO_LARGE = "too_large"  # over --max-message-mib
    BAD_LAYOUT = "bad_layout"  # registration rejected
    UNKNOWN_INSTANCE = "unknown_instance"  # not registered (or the server restarted)
    LAYOUT_MISMATCH = "layout_mismatch"  # fingerprint differs from the registered one
    BAD_REQUEST = "bad_request"  # block ids outside the buffers, wrong counts, ...
    UNKNOWN_LOOKUP = "unknown_lookup"  # lookup id released, retrieved or expired
    UNAUTHORIZED = "unauthorized"  # a wrong or missing auth secret or registration token
    LIMIT = "limit"  # a cap was reached (registrations); try again after others leave
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class GroupLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One engine KV cache group. `window_tokens`: the sliding window W (sliding), the attention
    chunk C (chunked), -1 otherwise. `page_bytes`: bytes of one layer's page of one block.

    `layer_page_bytes` (a group of mixed pages: MLA latents + indexer keys, MiniMax-M3): the page
    bytes of each of its `num_layers` layers; `page_bytes` is then the largest of them. None for a
    group whose layers share one page size (every layout before it existed).

    `layer_buffers` (DeepSeek-V4's packed layout, several groups in one segment): the buffer index
    of each layer. None: layer j lives in buffer j (vLLM's shared tensors).

    `state_pages` > 1 (a state group of the multi-page state layout): this group holds page `state_page`
    of a state spanning `state_pages` pages; groups `gid - state_page .. + state_pages - 1` are the pages
    of one state, and the server keeps them as one object group (one opaque state object per chunk)."""

    kind: GroupKind
    num_layers: int
    block_tokens: int
    page_bytes: int
    window_tokens: int = -1
    layer_page_bytes: list[int] | None = None
    layer_buffers: list[int] | None = None
    state_page: int = 0
    state_pages: int = 1


class BufferLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One buffer in a segment the engine passes as a file descriptor. `shm_name` labels the segment:
    buffers with the same label share one segment, and the register request passes one descriptor
    per distinct label, in order of first appearance."""

    shm_name: str
    size_bytes: int
    page_stride_bytes: int = 0  # bytes between blocks in this buffer; 0: the layout's page_stride_bytes
    offset_bytes: int = 0  # where block 0's page starts in the segment (a layer packed inside each block)


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine registers. `fingerprint` identifies the layout: objects are never shared
    between layouts with different fingerprints (it is part of every key)."""

    model: str
    rank: int
    world_size: int
    groups: list[GroupLayout]
    buffers: list[BufferLayout]
    num_blocks: int
    page_stride_bytes: int
    fingerprint: str


def segment_labels(layout: Layout) -> list[str]:
    """The distinct segment labels of `layout` in order of first appearance: the register request
    passes one file descriptor per label, in this order."""
    return list(dict.fromkeys(buf.shm_name for buf in layout.buffers))


class ObjectGroupInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # "full", "window:4" (chunks), "chunked:8192" (tokens), "state:g3", "all"
    groups: list[int]  # engine group indices stored in it


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """A chunk an object group did not commit, and why."""

    chunk: int  # chunk index in the request
    object_group: str
    reason: str


# ---- requests -------------------------------------------------------------------------------


class Request(msgspec.Struct, tag_field="op", kw_only=True):
    req_id: int
    auth: str = ""  # the server's shared secret (--auth-token-file), when it has one


class RegistrationAccess(Enum):
    COPY = "copy"  # the engine passes its segments: lookup, store, retrieve
    LOOKUP_ONLY = "lookup_only"  # no segments (vLLM's scheduler in its own process): lookup and release


class HelloRequest(Request, tag="hello", kw_only=True):
    """Where to register (the server's Unix domain socket); a cheap liveness probe."""


class RegisterRequest(Request, tag="register", kw_only=True):
    """Sent on the registration socket (a Unix SEQPACKET socket), never on the control channel: the
    message carries the segments' file descriptors (SCM_RIGHTS). The connection is the registration's
    lease: when it closes (the engine exited or was killed) the server unregisters it."""

    layout: Layout
    access: RegistrationAccess = RegistrationAccess.COPY


class UnregisterRequest(Request, tag="unregister", kw_only=True):
    instance_id: int
    token: str = ""


class LookupRequest(Request, tag="lookup", kw_only=True):
    """`chunk_hashes[i]`: chained hash of chunks 0..i of the request's tokens (full chunks only);
    `num_tokens`: the request's length (the last token is never counted as a hit)."""

    instance_id: int
    token: str = ""  # the registration's secret (the register reply's `token`)
    fingerprint: str
    chunk_hashes: list[bytes]
    num_tokens: int
    cache_salt: str = ""


class StoreRequest(Request, tag="store", kw_only=True):
    """Store chunks `first_chunk .. first_chunk + len(chunk_hashes) - 1`. `block_ids[g]`: engine
    group g's block ids covering exactly those chunks (0 = null block). `parent_hash`: chunk
    first_chunk - 1's hash (empty: not sent); it places the chunks in the server's prefix tree,
    which orders eviction (never what a lookup answers)."""

    instance_id: int
    token: str = ""  # the registration's secret (the register reply's `token`)
    fingerprint: str
    first_chunk: int
    chunk_hashes: list[bytes]
    block_ids: list[list[int]]
    cache_salt: str = ""
    parent_hash: bytes = b""


class RetrieveRequest(Request, tag="retrieve", kw_only=True):
    """Copy the hit of lookup `lookup_id` (or its first `num_tokens`, a multiple of the chunk
    size) into the engine's blocks. `block_ids[g]`: group g's block ids covering tokens
    [0, num_tokens) (0 where the engine needs nothing); the lookup's locks are released.
    Blocks that end at or before `skip_tokens` (the engine's own prefix hit) are not written
    and may be 0. The pages go into the buffers of registration `instance_id`; the lookup may have
    been made by another registration of the same layout (vLLM's scheduler in its own process)."""

    instance_id: int
    token: str = ""  # the registration's secret (the register reply's `token`)
    fingerprint: str
    lookup_id: int
    block_ids: list[list[int]]
    num_tokens: int = -1  # -1: the whole hit
    skip_tokens: int = 0


class ReleaseRequest(Request, tag="release", kw_only=True):
    instance_id: int
    token: str = ""  # the registration's secret (the register reply's `token`)
    lookup_id: int


class ClearRequest(Request, tag="clear", kw_only=True):
    pass


class StatusRequest(Request, tag="status", kw_only=True):
    pass


AnyRequest = (
    HelloRequest | RegisterRequest | UnregisterRequest | LookupRequest | StoreRequest | RetrieveRequest
    | ReleaseRequest | ClearRequest | StatusRequest
)
OPS = ("hello", "register", "unregister", "lookup", "store", "retrieve", "release", "clear", "status")

# ---- replies --------------------------------------------------------------------------------


class Reply(msgspec.Struct, tag_field="kind", kw_only=True):
    req_id: int


class ErrorReply(Reply, tag="error"):
    code: ErrorCode
    message: str


class HelloReply(Reply, tag="hello"):
    registration_socket: str  # a Unix socket address; "@name" is Linux's abstract namespace
    auth_required: bool


class RegisterReply(Reply, tag="registered"):
    instance_id: int
    token: str  # the secret every later request on this registration carries
    chunk_tokens: int
    object_groups: list[ObjectGroupInfo]


class LookupReply(Reply, tag="lookup"):
    """`hit_tokens`: the longest prefix every object group serves; `object_group_hit_tokens`:
    each object group's own longest prefix (same order as registration's object groups). The
    chunks of the hit stay locked until retrieve, release or `lock_ttl_s`."""

    lookup_id: int
    hit_tokens: int
    object_group_hit_tokens: list[int]
    lock_ttl_s: float


class StoreReply(Reply, tag="store"):
    """`stored[i]`: chunk first_chunk + i is committed by every object group (or not needed by
    it); `refusals`: what was not committed and why. Nothing is reported stored that is not."""

    stored: list[bool]
    refusals: list[Refusal]  # at most 64 (the server's limit); the rest are counted in refusals_left_out
    object_group_bytes: list[int] = []  # page bytes copied from the engine, per object group
    refusals_left_out: int = 0


class RetrieveReply(Reply, tag="retrieve"):
    retrieved_tokens: int
    bytes_copied: int
    object_group_bytes: list[int] = []  # page bytes copied to the engine, per object group


class OkReply(Reply, tag="ok"):
    pass


class ClearReply(Reply, tag="cleared"):
    objects_removed: int  # from L1
    problems: list[str] = []  # what an L2 tier could not clear, e.g. files it could not delete (and how many)


class StatusReply(Reply, tag="status"):
    status: dict[str, Any]


AnyReply = (
    ErrorReply | HelloReply | RegisterReply | LookupReply | StoreReply | RetrieveReply | OkReply | ClearReply
    | StatusReply
)

_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_reply_decoder = msgspec.msgpack.Decoder(AnyReply)
_encoder = msgspec.msgpack.Encoder()


class ProtocolError(ValueError):
    """A frame that is not a valid message; `code` and `req_id` (0 if unreadable) for the reply."""

    def __init__(self, code: ErrorCode, message: str, req_id: int) -> None:
        super().__init__(message)
        self.code = code
        self.req_id = req_id


def encode(message: Request | Reply) -> bytes:
    return _encoder.encode(message)


# What msgspec raises on hostile bytes besides DecodeError: a string that is not UTF-8
# (UnicodeDecodeError, a ValueError) and nesting deeper than its recursion limit.
_DECODE_ERRORS = (msgspec.DecodeError, ValueError, RecursionError)


def decode_request(frame: bytes) -> AnyRequest:
    """The request in `frame`; raises ProtocolError (BAD_MESSAGE or UNKNOWN_OP) and nothing else
    for any bytes at all."""
    try:
        request: AnyRequest = _request_decoder.decode(frame)
        return request
    except _DECODE_ERRORS as e:
        req_id, op = _salvage(frame)
        if op is not None and op not in OPS:
            raise ProtocolError(ErrorCode.UNKNOWN_OP,
                                f"unknown op {op!r:.80}; expected one of {list(OPS)}", req_id) from None
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"malformed request ({len(frame)} bytes): {e}",
                            req_id) from None


def _salvage(frame: bytes) -> tuple[int, object]:
    """Best effort: the req_id and op of an invalid request, so the error reaches its sender."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except _DECODE_ERRORS:
        return 0, None
    if not isinstance(raw, dict):
        return 0, None
    req_id, op = raw.get("req_id"), raw.get("op")
    # a req_id the reply could not carry (msgpack ints are 64-bit) is not salvaged
    return (req_id if isinstance(req_id, int) and -(1 << 63) <= req_id < (1 << 64) else 0), \
        (op if isinstance(op, str) else None)


def decode_reply(frame: bytes) -> AnyReply:
    reply: AnyReply = _reply_decoder.decode(frame)
    return reply


def layout_fingerprint(model: str, groups: Sequence[GroupLayout]) -> str:
    """What decides the bytes of an object: the model and every group's kind, layers, block, window and
    page size(s) (not the buffer names, sizes or block counts, which differ between engine processes).

    A group without `layer_page_bytes` is encoded exactly as before that field existed, so the
    fingerprints of those layouts (and the keys of objects already in an L2 tier) never change."""
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode([model, [_fingerprint_fields(g) for g in groups]]))


def _fingerprint_fields(g: GroupLayout) -> dict[str, Any]:
    fields: dict[str, Any] = {"kind": g.kind.value, "num_layers": g.num_layers, "block_tokens": g.block_tokens,
                              "page_bytes": g.page_bytes, "window_tokens": g.window_tokens}
    if g.layer_page_bytes is not None:
        fields["layer_page_bytes"] = list(g.layer_page_bytes)
    if g.state_pages > 1:  # absent for one-page states: their fingerprints are unchanged
        fields["state_page"], fields["state_pages"] = g.state_page, g.state_pages
    return fields
