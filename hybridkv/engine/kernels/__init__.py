"""Native kernels for the reference engine, built on first use with the system's C compiler.

- `paged_decode` (`paged_decode.c`): decode attention that reads the paged KV cache in place.
  torch has no CPU op that reads K/V through a block table, so the plain-torch path gathers each
  row's blocks into a contiguous copy and runs SDPA on it; for a decode row that is the whole
  cost (a 700-key full-attention decode of the Gemma 3 benchmark: ~5 ms of gather and ~8 ms of
  SDPA for 32 rows, where the kernel reads each K and V row once).
- `rms_norm` (`rms_norm.c`): RMSNorm in one pass per row, where torch's CPU `F.rms_norm` runs six
  separate ops (12% of a one-thread Gemma 3 benchmark pass).
- `gated_act` (`gated_act.c`): act(gate) * up of a gated MLP in one pass (GELU-tanh, SiLU).
- `gdn_scan`, `mamba2_scan` (`state_scan.c`): the Gated DeltaNet and Mamba2 recurrences token by
  token on the paged state in place, for decodes and prefill chunks of one step in one call.

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
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

_SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
_HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-Wl,-z,defs")
_LIBS = ("-lm",)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def kernels_enabled() -> bool:
    """False when `HYBRIDKV_KERNELS=0` asks for the plain-torch paths."""
    return os.environ.get("HYBRIDKV_KERNELS", "1") != "0"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: atomic for
        partial = Path(tmp) / target.name  # concurrent first uses (pytest-xdist, several engines)
        result = subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(partial), *_LIBS],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed (exit {result.returncode}): {result.stderr.strip()[:2000]}")
        os.replace(partial, target)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (disabled, or no working compiler: warned once)."""
    if not kernels_enabled():
        return None
    compiler = os.environ.get("CC", "cc")
    parts = [*(source.read_bytes() for source in _SOURCES + _HEADERS), " ".join(_FLAGS + _LIBS).encode(),
             compiler.encode(), _cpu_features().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    cache = Path(os.environ.get("HYBRIDKV_KERNEL_CACHE", Path.home() / ".cache" / "hybridkv" / "kernels"))
    target = cache / f"hybridkv_kernels-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
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
    lib.gdn_scan_f32.argtypes = [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR,
                                 _I64, _I64, _I64, _I64, _PTR, ctypes.c_int]
    lib.mamba2_scan_f32.restype = None
    lib.mamba2_scan_f32.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64,
                                    _PTR, _I64, _I64, _I64, _I64, _PTR, ctypes.c_int]
    lib.rms_norm_f32.restype = None
    lib.rms_norm_f32.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int]
    return lib


def kernels_available() -> bool:
    """True when the kernels are built and loaded (see the module docstring)."""
    return _library() is not None


paged_decode_available = kernels_available


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
    lib.gated_act_f32(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), code, torch.get_num_threads())
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
                     dim, eps, torch.get_num_threads())
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
        scale, softcap or 0.0, None if sink_ptr is None else sink_ptr.data_ptr(), torch.get_num_threads())
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
    packed = torch.empty(state.shape[1:]).stride()
    if state.dtype != torch.float32 or state.stride()[1:] != packed:
        raise ValueError(f"state: expected float32 [num_blocks, *S] with each block packed, got {state.dtype} "
                         f"strides {state.stride()}")
    return state.stride(0)


def state_scan_supported(state: torch.Tensor) -> bool:
    """True when the native scans can run on this state view (float32, kernels built)."""
    return state.dtype == torch.float32 and kernels_available()


def gdn_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, plan: torch.Tensor, checkpoints: torch.Tensor, *, threads: int) -> torch.Tensor:
    """The Gated DeltaNet recurrence over a step's sequences (see `state_scan.c`), states in place.

    q, k [T, Hk, Dk] (normalised, q scaled; one token stride), v [T, H, Dv], g, beta [T, H];
    state [num_blocks, H, Dv, Dk] float32; plan / checkpoints from `StateMetadata`. Returns o [T, H, Dv].
    """
    lib = _loaded()
    tokens, heads, dv = v.shape
    key_heads, dk = k.shape[1], k.shape[2]
    qk_stride = _rows(q, "q")
    if _rows(k, "k") != qk_stride or q.shape != k.shape:
        raise ValueError(f"gdn_scan: q {tuple(q.shape)} and k {tuple(k.shape)} must share shape and token stride")
    if heads % key_heads or state.shape[1:] != (heads, dv, dk):
        raise ValueError(f"gdn_scan: state {tuple(state.shape)} does not fit v {tuple(v.shape)} and k {tuple(k.shape)}")
    g, beta = g.float().contiguous(), beta.float().contiguous()
    plan, checkpoints = plan.contiguous(), checkpoints.contiguous()
    out = torch.empty(tokens, heads, dv)
    lib.gdn_scan_f32(q.data_ptr(), k.data_ptr(), qk_stride, v.data_ptr(), _rows(v, "v"), g.data_ptr(),
                     beta.data_ptr(), state.data_ptr(), _state_block_stride(state), plan.data_ptr(), plan.shape[0],
                     checkpoints.data_ptr(), heads, key_heads, dv, dk, out.data_ptr(), threads)
    return out


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor, plan: torch.Tensor, checkpoints: torch.Tensor,
                threads: int) -> torch.Tensor:
    """The Mamba2 recurrence over a step's sequences (see `state_scan.c`), states in place.

    x [T, H, P], dt [T, H] (after softplus and clamp), b, c [T, G, N] (one token stride), a, d [H];
    state [num_blocks, H, P, N] float32; plan / checkpoints from `StateMetadata`. Returns y [T, H, P].
    """
    lib = _loaded()
    tokens, heads, p = x.shape
    groups, n = b.shape[1], b.shape[2]
    bc_stride = _rows(b, "b")
    if _rows(c, "c") != bc_stride or b.shape != c.shape:
        raise ValueError(f"mamba2_scan: b {tuple(b.shape)} and c {tuple(c.shape)} must share shape and token stride")
    if heads % groups or state.shape[1:] != (heads, p, n):
        raise ValueError(f"mamba2_scan: state {tuple(state.shape)} does not fit x {tuple(x.shape)} "
                         f"and b {tuple(b.shape)}")
    dt = dt.float().contiguous()
    a, d = a.float().contiguous(), d.float().contiguous()
    plan, checkpoints = plan.contiguous(), checkpoints.contiguous()
    out = torch.empty(tokens, heads, p)
    lib.mamba2_scan_f32(x.data_ptr(), _rows(x, "x"), b.data_ptr(), c.data_ptr(), bc_stride, dt.data_ptr(),
                        a.data_ptr(), d.data_ptr(), state.data_ptr(), _state_block_stride(state), plan.data_ptr(),
                        plan.shape[0], checkpoints.data_ptr(), heads, groups, p, n, out.data_ptr(), threads)
    return out
