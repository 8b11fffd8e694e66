"""Native kernels for the reference engine, built on first use with the system's C compiler.

- `paged_decode` (`paged_decode.c`): decode attention that reads the paged KV cache in place.
  torch has no CPU op that reads K/V through a block table, so the plain-torch path gathers each
  row's blocks into a contiguous copy and runs SDPA on it; for a decode row that is the whole
  cost (a 700-key full-attention decode of the Gemma 3 benchmark: ~5 ms of gather and ~8 ms of
  SDPA for 32 rows, where the kernel reads each K and V row once).
- `rms_norm` (`rms_norm.c`): RMSNorm in one pass per row, where torch's CPU `F.rms_norm` runs six
  separate ops (12% of a one-thread Gemma 3 benchmark pass).
- `gated_act` (`gated_act.c`): act(gate) * up of a gated MLP in one pass (GELU-tanh, SiLU).
- `causal_conv` (`causal_conv.c`), `gated_rms_norm` (`rms_norm.c`): the state mixers' depthwise
  conv with its conv states (and SiLU), and their gated norms, each one pass.
- `gdn_scan`, `mamba2_scan`, `mamba1_scan` (`state_scan.c`): the Gated DeltaNet, Mamba2 and Mamba1
  recurrences token by token on the paged state in place, for decodes and prefill chunks of one
  step in one call.

The shared object (every `*.c` here) is compiled with `$CC` (default `cc`) into `$HYBRIDKV_KERNEL_CACHE` (default
`~/.cache/hybridkv/kernels`), named by a hash of the source, the flags and the CPU's features
(it is built with `-march=native`), so a rebuild happens only when one of them changes (~1 s).
OpenMP threads come from the libgomp that torch has already loaded: one thread pool, not two.
`HYBRIDKV_KERNELS=0` turns the kernels off; without a compiler the engine warns once and uses
the plain-torch path (the same results within float32 rounding).
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import torch

from hybridkv.engine.threads import kernel_threads
from hybridkv.native_build import kernels_enabled, shared_object

_SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
_HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
#: -ffast-math's parts, not -ffast-math itself: linked with it (or -funsafe-math-optimizations) GCC adds a
#: start-up routine that sets flush-to-zero for the whole process, so loading the kernels would change every
#: float the user's program computes after (subnormals read as 0)
_FAST_MATH = ("-fno-math-errno", "-fassociative-math", "-freciprocal-math", "-fno-signed-zeros", "-fno-trapping-math",
              "-ffinite-math-only", "-fcx-limited-range")
_FLAGS = ("-O3", "-march=native", *_FAST_MATH, "-fopenmp", "-shared", "-fPIC", "-Wl,-z,defs")
_LIBS = ("-lm",)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (disabled, or no working compiler: warned once)."""
    if not kernels_enabled():
        return None
    try:
        lib = ctypes.CDLL(str(shared_object("hybridkv_kernels", _SOURCES, flags=_FLAGS, libs=_LIBS,
                                            key_files=_HEADERS, extra_key=_cpu_features())))
    except OSError as error:
        warnings.warn(f"hybridkv: native kernels unavailable, using the plain-torch attention path ({error})",
                      RuntimeWarning, stacklevel=3)
        return None
    lib.paged_decode_f32.restype = ctypes.c_int
    lib.paged_decode_f32.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
                                     ctypes.c_float, ctypes.c_float, _PTR, ctypes.c_int]
    lib.gated_act_f32.restype = None
    lib.gated_act_f32.argtypes = [_PTR, _PTR, _PTR, _I64, ctypes.c_int, ctypes.c_int]
    lib.gdn_scan_f32.restype = None
    lib.gdn_scan_f32.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR,
                                 _I64, _I64, _I64, _I64, _PTR, ctypes.c_int]
    lib.mamba2_scan_f32.restype = None
    lib.mamba2_scan_f32.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, ctypes.c_float, ctypes.c_float,
                                    _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR,
                                    ctypes.c_int]
    lib.mamba1_scan_f32.restype = None
    lib.mamba1_scan_f32.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64,
                                    _PTR, _I64, _I64, _PTR, ctypes.c_int]
    lib.causal_conv_f32.restype = None
    lib.causal_conv_f32.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR,
                                    ctypes.c_int, _PTR, ctypes.c_int]
    lib.gated_rms_norm_f32.restype = None
    lib.gated_rms_norm_f32.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, ctypes.c_float,
                                       ctypes.c_int, ctypes.c_int]
    lib.rms_norm_f32.restype = None
    lib.rms_norm_f32.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int]
    return lib


def kernels_available() -> bool:
    """True when the kernels are built and loaded (see the module docstring)."""
    return _library() is not None



def usable(*tensors: torch.Tensor) -> bool:
    """True when the kernels are built and every tensor given is float32 (the kernels' one dtype)."""
    return all(t.dtype == torch.float32 for t in tensors) and kernels_available()


def _loaded() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("a native kernel was called while the kernels are unavailable; "
                           "check kernels_available() first")
    return lib


GATED_ACTS = {"gelu_pytorch_tanh": 0, "silu": 1}  # HF activation name -> the kernel's code


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up elementwise, for float32 tensors of one shape and `act` in `GATED_ACTS`.

    Call only when `kernels_available()`; no autograd (the engine runs under inference mode).
    """
    code = GATED_ACTS.get(act)
    if code is None:
        raise ValueError(f"gated_act: unsupported activation {act!r}; supported: {', '.join(GATED_ACTS)}")
    if gate.shape != up.shape:
        raise ValueError(f"gated_act: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    lib = _loaded()
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    lib.gated_act_f32(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), code, kernel_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight, for float32 x [..., dim] and weight [dim] (or None).

    Call only when `kernels_available()`; no autograd (the engine runs under inference mode).
    """
    lib = _loaded()
    x = x.contiguous()
    w = None if weight is None else weight.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.rms_norm_f32(x.data_ptr(), None if w is None else w.data_ptr(), out.data_ptr(), x.numel() // max(dim, 1),
                     dim, eps, kernel_threads())
    return out


def paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    key_lo: torch.Tensor,
    key_hi: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over key slots [key_lo[r], key_hi[r]) of its blocks.

    q [R, H, D] float32; cache [num_blocks, 2, block_size, KVH, D] float32 (contiguous);
    block_ids [R, B] int64; key_lo / key_hi [R] int64 (slot j = offset j % block_size of block
    block_ids[r, j // block_size]); sinks [H] float32 or None. Returns [R, H, D].
    Call only when `kernels_available()`.
    """
    lib = _loaded()
    rows, heads, head_dim = q.shape
    q = q.contiguous()
    block_ids, key_lo, key_hi = block_ids.contiguous(), key_lo.contiguous(), key_hi.contiguous()
    sink_ptr = None if sinks is None else sinks.float().contiguous()
    out = torch.empty_like(q)
    status = lib.paged_decode_f32(
        q.data_ptr(), cache.data_ptr(), block_ids.data_ptr(), key_lo.data_ptr(), key_hi.data_ptr(),
        out.data_ptr(), rows, heads, cache.shape[3], head_dim, cache.shape[2], block_ids.shape[1],
        scale, softcap or 0.0, None if sink_ptr is None else sink_ptr.data_ptr(), kernel_threads())
    if status != 0:
        raise MemoryError(f"paged_decode: the kernel failed (status {status}: 1 = out of memory, "
                          f"2 = more than 256 query heads, got {heads})")
    return out


def _rows(x: torch.Tensor, name: str) -> int:
    """The token stride of x [T, heads, dim] whose last two dims are packed (any token stride)."""
    if x.dtype != torch.float32 or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        raise ValueError(f"{name}: expected float32 [T, heads, dim] with packed heads, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    return x.stride(0)


def _state_block_stride(state: torch.Tensor) -> int:
    """The block stride of a state view [num_blocks, *S] float32 whose block part is packed."""
    if state.dtype != torch.float32 or not state[0].is_contiguous():  # a view: no allocation per call
        raise ValueError(f"state: expected float32 [num_blocks, *S] with each block packed, got {state.dtype} "
                         f"strides {state.stride()}")
    return state.stride(0)




def _token_rows(x: torch.Tensor, name: str) -> int:
    """The token stride of x [T, n] float32 whose n values are packed (any token stride)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: expected float32 [T, n] with packed values, got {x.dtype} {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x.stride(0)


GDN_MAX_DK = 512  # state_scan.c keeps a token's normalised q and k on the stack
# Below these sizes a kernel runs on one thread: an OpenMP fork and join costs more than the work
# saves (with OMP_WAIT_POLICY=PASSIVE, waking a sleeping thread took ~50 us here).
SCAN_PARALLEL_MIN = 1 << 19  # tokens x heads x state elements per head (~100 us of work)
CONV_PARALLEL_MIN = 1 << 16  # tokens x channels, as rms_norm.c and gated_act.c


def gdn_scan(conv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, a_log: torch.Tensor, dt_bias: torch.Tensor,
             key_heads: int, state: torch.Tensor, plan: torch.Tensor, checkpoints: torch.Tensor,
             threads: int) -> torch.Tensor:
    """The Gated DeltaNet layer's recurrence over a step's sequences (see `state_scan.c`), states in place.

    conv [T, 2*Hk*Dk + H*Dv]: the activated conv outputs (q | k | v channel blocks, raw: L2
    normalisation and the Dk^-0.5 scale happen inside); a, b [T, H]: the raw projections
    (g = -exp(a_log) softplus(a + dt_bias), beta = sigmoid(b) inside); state [num_blocks, H, Dv, Dk]
    float32; plan / checkpoints from `StateMetadata`. Returns o [T, H, Dv].
    """
    lib = _loaded()
    tokens, channels = conv.shape
    heads, dv, dk = state.shape[1:]
    ab_stride = _token_rows(a, "a")
    if _token_rows(b, "b") != ab_stride or a.shape != b.shape or a.shape != (tokens, heads):
        raise ValueError(f"gdn_scan: a {tuple(a.shape)} and b {tuple(b.shape)} must be [{tokens}, {heads}] "
                         "with one token stride")
    if heads % key_heads or channels != 2 * key_heads * dk + heads * dv or dk > GDN_MAX_DK:
        raise ValueError(f"gdn_scan: conv [{tokens}, {channels}] does not fit {key_heads} key heads and the state "
                         f"{tuple(state.shape)} (expected {2 * key_heads * dk + heads * dv} channels, "
                         f"Dk <= {GDN_MAX_DK})")
    a_log, dt_bias = a_log.float().contiguous(), dt_bias.float().contiguous()
    plan, checkpoints = plan.contiguous(), checkpoints.contiguous()
    out = torch.empty(tokens, heads, dv)
    lib.gdn_scan_f32(conv.data_ptr(), _token_rows(conv, "conv"), a.data_ptr(), b.data_ptr(), ab_stride,
                     a_log.data_ptr(), dt_bias.data_ptr(), state.data_ptr(), _state_block_stride(state),
                     plan.data_ptr(), plan.shape[0], checkpoints.data_ptr(), heads, key_heads, dv, dk,
                     out.data_ptr(), threads if tokens * heads * dv * dk >= SCAN_PARALLEL_MIN else 1)
    return out


FLOAT32_MAX = 3.4028234663852886e38


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, dt_bias: torch.Tensor,
                dt_limit: tuple[float, float], a: torch.Tensor, d: torch.Tensor, state: torch.Tensor,
                plan: torch.Tensor, checkpoints: torch.Tensor, threads: int) -> torch.Tensor:
    """The Mamba2 recurrence over a step's sequences (see `state_scan.c`), states in place.

    x [T, H, P], dt [T, H] (the raw projection: the step is clamp(softplus(dt + dt_bias), *dt_limit)
    inside), b, c [T, G, N] (one token stride), a, d [H]; state [num_blocks, H, P, N] float32;
    plan / checkpoints from `StateMetadata`. Returns y [T, H, P].
    """
    lib = _loaded()
    tokens, heads, p = x.shape
    groups, n = b.shape[1], b.shape[2]
    bc_stride = _rows(b, "b")
    if _rows(c, "c") != bc_stride or b.shape != c.shape:
        raise ValueError(f"mamba2_scan: b {tuple(b.shape)} and c {tuple(c.shape)} must share shape and token stride")
    if heads % groups or state.shape[1:] != (heads, p, n) or dt.shape != (tokens, heads):
        raise ValueError(f"mamba2_scan: state {tuple(state.shape)} and dt {tuple(dt.shape)} do not fit "
                         f"x {tuple(x.shape)} and b {tuple(b.shape)}")
    a, d, dt_bias = a.float().contiguous(), d.float().contiguous(), dt_bias.float().contiguous()
    low, high = (min(max(v, -FLOAT32_MAX), FLOAT32_MAX) for v in dt_limit)  # the kernel assumes finite floats
    plan, checkpoints = plan.contiguous(), checkpoints.contiguous()
    out = torch.empty(tokens, heads, p)
    lib.mamba2_scan_f32(x.data_ptr(), _rows(x, "x"), b.data_ptr(), c.data_ptr(), bc_stride, dt.data_ptr(),
                        _token_rows(dt, "dt"), dt_bias.data_ptr(), low, high, a.data_ptr(), d.data_ptr(),
                        state.data_ptr(), _state_block_stride(state), plan.data_ptr(), plan.shape[0],
                        checkpoints.data_ptr(), heads, groups, p, n, out.data_ptr(),
                        threads if tokens * heads * p * n >= SCAN_PARALLEL_MIN else 1)
    return out


def mamba1_scan(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor, plan: torch.Tensor, checkpoints: torch.Tensor,
                threads: int) -> torch.Tensor:
    """The Mamba1 selective scan over a step's sequences (see `state_scan.c`), states in place.

    x, dt [T, I] (dt after softplus; any token strides), b, c [T, N] (one token stride), a [I, N]
    (negative), d [I]; state [num_blocks, I, N] float32; plan / checkpoints from `StateMetadata`.
    Returns y [T, I].
    """
    lib = _loaded()
    tokens, channels = x.shape
    n = b.shape[1]
    bc_stride = _token_rows(b, "b")
    if _token_rows(c, "c") != bc_stride or b.shape != c.shape or dt.shape != x.shape:
        raise ValueError(f"mamba1_scan: b {tuple(b.shape)}, c {tuple(c.shape)} (one token stride) and dt "
                         f"{tuple(dt.shape)} do not fit x {tuple(x.shape)}")
    if state.shape[1:] != (channels, n) or a.shape != (channels, n):
        raise ValueError(f"mamba1_scan: state {tuple(state.shape)} and a {tuple(a.shape)} do not fit "
                         f"[{channels}, {n}]")
    a, d = a.float().contiguous(), d.float().contiguous()
    plan, checkpoints = plan.contiguous(), checkpoints.contiguous()
    out = torch.empty(tokens, channels)
    lib.mamba1_scan_f32(x.data_ptr(), _token_rows(x, "x"), dt.data_ptr(), _token_rows(dt, "dt"), b.data_ptr(),
                        c.data_ptr(), bc_stride, a.data_ptr(), d.data_ptr(), state.data_ptr(),
                        _state_block_stride(state), plan.data_ptr(), plan.shape[0], checkpoints.data_ptr(), channels,
                        n, out.data_ptr(), threads if tokens * channels * n >= SCAN_PARALLEL_MIN else 1)
    return out


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None,
                plan: torch.Tensor, checkpoints: torch.Tensor, *, silu: bool, threads: int) -> torch.Tensor:
    """The depthwise causal conv of a step's sequences (see `causal_conv.c`), conv states stored.

    x [T, C] float32 (any token stride); conv_state [num_blocks, K-1, C] float32 (rows packed);
    taps [K, C]; bias [C] or None; plan / checkpoints from `StateMetadata`. Returns [T, C] (SiLU'd if `silu`).
    """
    lib = _loaded()
    tokens, channels = x.shape
    kernel = taps.shape[0]
    if x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"causal_conv: expected float32 x [T, C] with packed channels, got {x.dtype} "
                         f"strides {x.stride()}")
    if (conv_state.shape[1:] != (kernel - 1, channels) or conv_state.stride(2) != 1
            or conv_state.dtype != torch.float32):
        raise ValueError(f"causal_conv: conv state {tuple(conv_state.shape)} {conv_state.dtype} does not fit "
                         f"{kernel} taps of {channels} channels (expected float32 [blocks, {kernel - 1}, {channels}])")
    taps = taps.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    plan, checkpoints = plan.contiguous(), checkpoints.contiguous()
    out = torch.empty(tokens, channels)
    lib.causal_conv_f32(x.data_ptr(), x.stride(0), conv_state.data_ptr(), conv_state.stride(0), conv_state.stride(1),
                        taps.data_ptr(), None if bias is None else bias.data_ptr(), channels, kernel, plan.data_ptr(),
                        plan.shape[0], checkpoints.data_ptr(), int(silu), out.data_ptr(),
                        threads if tokens * channels >= CONV_PARALLEL_MIN else 1)
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, *, parts: int, eps: float,
                   gate_first: bool, threads: int) -> torch.Tensor:
    """x, z [T, parts * dim] float32 (any token stride), weight [dim] (shared by the parts) or
    [parts * dim]; each part of `dim` channels normalised on its own (see `rms_norm.c`):
    gate_first: rmsnorm(x * silu(z)) * weight; else rmsnorm(x) * weight * silu(z). Returns [T, parts * dim].
    """
    lib = _loaded()
    tokens, width = x.shape
    dim = width // parts
    if z.shape != x.shape or width % parts or x.stride(1) != 1 or z.stride(1) != 1:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and z {tuple(z.shape)} must be [T, parts * dim] with "
                         f"packed channels (parts {parts})")
    if x.dtype != torch.float32 or z.dtype != torch.float32 or weight.numel() not in (dim, width):
        raise ValueError(f"gated_rms_norm: expected float32 x, z and a weight of {dim} or {width}, got "
                         f"{x.dtype}, {z.dtype}, {weight.numel()}")
    w = weight.float().contiguous()
    out = torch.empty(tokens, width)
    lib.gated_rms_norm_f32(x.data_ptr(), x.stride(0), z.data_ptr(), z.stride(0), w.data_ptr(),
                           dim if w.numel() == width else 0, out.data_ptr(), tokens * parts, parts, dim, eps,
                           int(gate_first), threads)
    return out
