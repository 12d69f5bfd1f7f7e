"""Native CPU kernels (``cpu_native.c``): built on first use with the system C compiler, as DeepSpeed
builds its ops, and called through ctypes on fp32 CPU tensors in eager mode.

Each kernel is one pass over memory where torch composes several elementwise ops:

    SwiGLU of y = [g | u]:   h = g s(g) u,  s = sigmoid;
                             du = dh g s(g),  dg = dh u s(g) (1 + g (1 - s(g)))
    dropout:                 y = x m / q,  m_e = [R(seed, e) >= t],  t = round(p 2^32),  q = 1 - t / 2^32
                             dx = dy m / q
    attention probabilities: P = softmax(S + M_causal),  Pd = P m / q   (one kernel, m saved as bytes)
                             dS = P (dP - sum_j P_j dP_j),  dP = dPd m / q
    attention (no dropout):  O = softmax(scale Q K^T + M_causal) V by FlashAttention-2's blocks (32
                             queries x 64 keys, online softmax, lse saved); backward recomputes P
                             from lse: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)),
                             dQ = scale dS K, dK = scale dS^T Q; the block products on an AVX2 4x16
                             register-tiled kernel; one work unit per (batch, key/value head)
    RMSNorm:                 r = 1 / sqrt(|x|^2 / n + eps),  y = x r w;
                             dx = r dy w - x r^3 (dy w . x) / n,  dw = sum_rows dy x r
    RoPE (halves x1, x2):    y1 = x1 c - x2 s,  y2 = x2 c + x1 s   (backward: the same with -s)
    cross-entropy:           lse = log sum_{j<V} exp(z_j),  loss = lse - z_y,
                             dz_j = g (exp(z_j - lse) - [j = y])
                             over logits whose rows may hold padding columns j >= V (gradient 0 there)

R is a counter-based hash of the element index e keyed by a 63-bit seed drawn from torch's
generator (so ``torch.manual_seed``, checkpointed RNG state and the tensor-parallel RNG forks govern
it, and the mask does not depend on the thread count); the drop probability is p rounded to a
multiple of 2^-32 and E[y] = x exactly. exp is a range-reduced polynomial (~2 ulp), so results
match torch to fp32 rounding, not bit for bit (tests/unit/test_native_kernels.py).

Build: ``$CC`` (default ``cc``) ``-O3 -march=native -fopenmp`` into
``$MEGAFORMER_CACHE_DIR`` (default ``~/.cache/megaformer``)``/native/<hash>/``, the hash covering
the source, the flags, the compiler's version and this CPU's feature flags; written to a temporary
file and renamed, so concurrent ranks never load a half-written library. The cache folders are
created 0700; a cached library is loaded only when it and every folder up to the cache root belong
to this user and are not writable by group or others, and its sha256 matches the digest recorded at
build time; otherwise it is rebuilt (into a private temporary folder when the cache is not
private). No compiler, a failed build or ``MEGAFORMER_NATIVE=0``: the torch ops run instead, and :func:`status` says why (logged
once by the trainer and the bench). ``model.kernels=torch`` never uses them.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

SOURCE = Path(__file__).with_name("cpu_native.c")
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-std=gnu11",
    "-shared",
    "-fPIC",
)
_P, _I64, _U32, _F, _INT = (
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_uint32,
    ctypes.c_float,
    ctypes.c_int,
)
SIGNATURES = {
    "mf_swiglu_fwd": (_P, _P, _I64, _I64, _I64, _INT),
    "mf_swiglu_bwd": (_P, _P, _P, _I64, _I64, _I64, _INT),
    "mf_dropout_fwd": (_P, _P, _P, _I64, _U32, _U32, _U32, _F, _INT),
    "mf_masked_scale": (_P, _P, _P, _I64, _F, _INT),
    "mf_softmax_dropout_fwd": (
        _P,
        _P,
        _P,
        _P,
        _I64,
        _I64,
        _I64,
        _I64,
        _INT,
        _U32,
        _U32,
        _U32,
        _F,
        _INT,
    ),
    "mf_softmax_dropout_bwd": (_P, _P, _P, _P, _I64, _I64, _F, _INT),
    "mf_rmsnorm_fwd": (_P, _P, _P, _P, _I64, _I64, _F, _INT),
    "mf_rmsnorm_bwd": (_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _INT),
    "mf_rope": (_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _INT),
    "mf_flash_fwd": (_P,) * 5 + (_I64,) * 15 + (_F, _INT, _INT),
    "mf_flash_bwd": (_P,) * 9 + (_I64,) * 18 + (_F, _INT, _INT),
    "mf_xent_fwd": (_P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT),
    "mf_xent_bwd": (_P, _P, _P, _P, _I64, _I64, _I64, _I64, _F, _INT),
}

_lock = threading.Lock()
_state: dict = {}  # "lib": CDLL or None, "status": str


LIBRARY = "libmegaformer_native.so"


def _cache_root() -> Path:
    return Path(
        os.environ.get("MEGAFORMER_CACHE_DIR") or os.path.join(Path.home(), ".cache", "megaformer")
    )


def _cache_dir() -> Path:
    return _cache_root() / "native"


def _private(path: Path, want_dir: bool) -> bool:
    """``path`` (not a link) is owned by this user and not writable by group or others."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    return kind and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _trusted_path(path: Path, root: Path) -> bool:
    """The file and every folder from its own up to ``root`` are private to this user: nobody else
    could have planted or swapped the library."""
    if not _private(path, want_dir=False):
        return False
    d = path.parent
    while True:
        if not _private(d, want_dir=True):
            return False
        if d == root or d.parent == d:
            return d == root
        d = d.parent


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(target: Path, root: Path) -> bool:
    """A library built here before: private path (see :func:`_trusted_path`) and the sha256 digest
    recorded beside it at build time still matches."""
    digest = target.with_name(target.name + ".sha256")
    if not (_trusted_path(target, root) and _private(digest, want_dir=False)):
        return False
    try:
        return digest.read_text().strip() == _sha256(target)
    except OSError:
        return False


def _make_private_dirs(folder: Path, root: Path) -> bool:
    """Create ``root`` .. ``folder`` with mode 0700 where missing; True when all of them are then
    private to this user."""
    try:
        for d in [*reversed(folder.relative_to(root).parents), folder.relative_to(root)]:
            path = root / d
            if not path.exists():
                path.mkdir(mode=0o700, parents=True)
    except (OSError, ValueError):
        return False
    d = folder
    while True:
        if not _private(d, want_dir=True):
            return False
        if d == root:
            return True
        d = d.parent


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: str, folder: Path, source: Path, flags: Sequence[str], library: str) -> Path:
    """Build into ``folder`` under a random temporary name, record its sha256, rename into place."""
    target = folder / library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{compiler} failed: {last}")
        os.chmod(tmp, 0o700)
        fd, tmp_digest = tempfile.mkstemp(suffix=".sha256", dir=folder)
        with os.fdopen(fd, "w") as fh:
            fh.write(_sha256(Path(tmp)) + "\n")
        os.replace(tmp_digest, target.with_name(target.name + ".sha256"))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_library(
    compiler: str,
    source: Path,
    flags: Sequence[str],
    library: str,
    subdir: str,
    cpu_specific: bool = True,
) -> tuple[Path, Optional[str]]:
    """(path of the shared library built from ``source``, why it is a private one-off build or
    None). From the cache ``$MEGAFORMER_CACHE_DIR/<subdir>/<hash>/`` when verified (private folders
    up to the cache root, owned by this user, digest recorded at build time matching), else built
    there. A cache that is not private (another user could write it) is not used: the library is
    then built into a fresh private temporary folder, which the caller removes once it is loaded.
    The hash covers the source, the flags, the compiler's version and (``cpu_specific``) the CPU."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    parts = [source.read_text(), " ".join(flags), version] + (
        [_cpu_flags()] if cpu_specific else []
    )
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    root = _cache_root()
    folder = root / subdir / key
    target = folder / library
    if _verified(target, root):
        return target, None
    absent = not (target.exists() or target.is_symlink())
    if _make_private_dirs(folder, root) and (absent or _trusted_path(target, root)):
        # new, or ours with a digest that does not match
        return _compile(compiler, folder, source, flags, library), None
    private = Path(tempfile.mkdtemp(prefix="megaformer-native-"))  # 0700, this process only
    try:
        built = _compile(compiler, private, source, flags, library)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    return built, f"{root / subdir} is not private to this user"


def _load() -> tuple[Optional[ctypes.CDLL], str]:
    if os.environ.get("MEGAFORMER_NATIVE", "1") == "0":
        return None, "native CPU kernels off (MEGAFORMER_NATIVE=0)"
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return (
            None,
            f"native CPU kernels unavailable: no C compiler '{compiler}' on PATH (torch ops run)",
        )
    try:
        path, private = build_library(compiler, SOURCE, FLAGS, LIBRARY, "native")
        if private:
            _state["private_build"] = private
        lib = ctypes.CDLL(str(path))
        for name, args in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        _state.pop("private_build", None)
        return None, f"native CPU kernels unavailable ({e}); torch ops run"
    if "private_build" in _state:  # loaded (mapped): the private copy is not needed on disk
        shutil.rmtree(path.parent, ignore_errors=True)
        return lib, (
            f"native CPU kernels: built in a private temporary folder and loaded "
            f"({_state.pop('private_build')}, so it is not used)"
        )
    return lib, f"native CPU kernels: {path}"


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel library, building it on the first call; None where it cannot be had."""
    if "status" not in _state:
        with _lock:
            if "status" not in _state:
                _state["lib"], _state["status"] = _load()
    return _state["lib"]


def status() -> str:
    """One line: where the library was loaded from, or why the torch ops run instead."""
    library()
    return _state["status"]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block the torch ops run, as if the library did not load (tests, A/B timing)."""
    library()
    saved = dict(_state)
    _state["lib"], _state["status"] = None, "native CPU kernels off (native.disabled())"
    try:
        yield
    finally:
        _state.update(saved)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


def swiglu_forward(y: torch.Tensor) -> torch.Tensor:
    """h = SiLU(g) u of y = [g | u] on the last dimension."""
    y = y.contiguous()
    f = y.shape[-1] // 2
    h = torch.empty(*y.shape[:-1], f, dtype=y.dtype)
    library().mf_swiglu_fwd(_ptr(y), _ptr(h), y.numel() // (2 * f), f, 2 * f, _threads())
    return h


def swiglu_backward(y: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """[dg | du] for y = [g | u] and the output gradient dh."""
    y, dh = y.contiguous(), dh.contiguous()
    f = y.shape[-1] // 2
    dy = torch.empty_like(y)
    library().mf_swiglu_bwd(_ptr(y), _ptr(dh), _ptr(dy), y.numel() // (2 * f), f, 2 * f, _threads())
    return dy


def draw_keys() -> tuple[int, int]:
    """Two 32-bit keys from a 63-bit seed drawn from torch's default CPU generator."""
    seed = int(torch.empty((), dtype=torch.int64).random_())
    return seed & 0xFFFFFFFF, seed >> 32


def drop_threshold(p: float) -> tuple[int, float]:
    """(t, 1 / q): keep iff R >= t with t = round(p 2^32), q = 1 - t / 2^32."""
    t = min(round(p * 2**32), 2**32 - 1)
    return t, 2**32 / (2**32 - t)


def dropout_forward(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(y, keep mask as bool, scale) for contiguous x."""
    x = x.contiguous()
    y = torch.empty_like(x)
    m = torch.empty(x.shape, dtype=torch.bool)
    t, scale = drop_threshold(p)
    k0, k1 = draw_keys()
    library().mf_dropout_fwd(_ptr(x), _ptr(y), _ptr(m), x.numel(), k0, k1, t, scale, _threads())
    return y, m, scale


def masked_scale(x: torch.Tensor, m: torch.Tensor, scale: float) -> torch.Tensor:
    """x m scale (m a bool tensor of x's shape)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library().mf_masked_scale(_ptr(x), _ptr(m), _ptr(y), x.numel(), scale, _threads())
    return y


def softmax_dropout_forward(
    s: torch.Tensor, causal: bool, p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(P, Pd, m, scale) for scores s [..., T, S] (see the module docstring)."""
    s = s.contiguous()
    t_len, cols = s.shape[-2], s.shape[-1]
    rows = s.numel() // cols
    probs, dropped = torch.empty_like(s), torch.empty_like(s)
    m = torch.empty(s.shape, dtype=torch.bool)
    t, scale = drop_threshold(p)
    k0, k1 = draw_keys()
    library().mf_softmax_dropout_fwd(
        _ptr(s),
        _ptr(probs),
        _ptr(dropped),
        _ptr(m),
        rows,
        t_len,
        cols,
        cols - t_len,
        int(causal),
        k0,
        k1,
        t,
        scale,
        _threads(),
    )
    return probs, dropped, m, scale


def softmax_dropout_backward(
    probs: torch.Tensor, m: torch.Tensor, d_dropped: torch.Tensor, scale: float
) -> torch.Tensor:
    """dS from P, m and the gradient of Pd."""
    d_dropped = d_dropped.contiguous()
    ds = torch.empty_like(probs)
    cols = probs.shape[-1]
    library().mf_softmax_dropout_bwd(
        _ptr(probs),
        _ptr(m),
        _ptr(d_dropped),
        _ptr(ds),
        probs.numel() // cols,
        cols,
        scale,
        _threads(),
    )
    return ds


def cross_entropy_forward(
    logits: torch.Tensor, labels: torch.Tensor, vocab: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss, per-row lse) for logits [..., Vp] (the first ``vocab`` columns count) and
    int64 labels of the leading shape; rows labelled ``ignore_index`` get loss 0."""
    logits, labels = logits.contiguous(), labels.contiguous()
    rows, stride = labels.numel(), logits.shape[-1]
    loss, lse = torch.empty(rows), torch.empty(rows)
    library().mf_xent_fwd(
        _ptr(logits),
        _ptr(labels),
        _ptr(loss),
        _ptr(lse),
        rows,
        vocab,
        stride,
        ignore_index,
        _threads(),
    )
    return loss, lse


def cross_entropy_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    vocab: int,
    ignore_index: int,
    g: float,
) -> torch.Tensor:
    """d(g * sum of the rows' losses)/d logits, 0 in padding columns and ignored rows."""
    logits, labels = logits.contiguous(), labels.contiguous()
    dx = torch.empty_like(logits)
    library().mf_xent_bwd(
        _ptr(logits),
        _ptr(labels),
        _ptr(lse),
        _ptr(dx),
        labels.numel(),
        vocab,
        logits.shape[-1],
        ignore_index,
        g,
        _threads(),
    )
    return dx


def rmsnorm_forward(
    x: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r) for rows of x's last dimension; r = 1 / rms per row."""
    x, w = x.contiguous(), w.contiguous()
    n = x.shape[-1]
    y, rstd = torch.empty_like(x), torch.empty(x.numel() // n)
    library().mf_rmsnorm_fwd(
        _ptr(x), _ptr(w), _ptr(y), _ptr(rstd), x.numel() // n, n, eps, _threads()
    )
    return y, rstd


def rmsnorm_backward(
    x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of y = x r w."""
    x, dy = x.contiguous(), dy.contiguous()  # x may be a strided view of rows (as in forward)
    n, nt = x.shape[-1], _threads()
    dx, dw, work = torch.empty_like(x), torch.empty_like(w), torch.empty(nt, n)
    library().mf_rmsnorm_bwd(
        _ptr(x),
        _ptr(w),
        _ptr(rstd),
        _ptr(dy),
        _ptr(dx),
        _ptr(dw),
        _ptr(work),
        x.numel() // n,
        n,
        nt,
    )
    return dx, dw


def rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """RoPE of x [B, H, T, D] (any strides with the last dimension contiguous) by the half tables
    c, s [T, D/2]; the result is [B, H, T, D] with heads adjacent in memory ([B, T, H, D] storage)."""
    b, h, t, d = x.shape
    c, s = c.contiguous(), s.contiguous()
    y = torch.empty(b, t, h, d, dtype=x.dtype)
    library().mf_rope(
        _ptr(x),
        _ptr(c),
        _ptr(s),
        _ptr(y),
        b,
        t,
        h,
        d,
        x.stride(0),
        x.stride(2),
        x.stride(1),
        _threads(),
    )
    return y.transpose(1, 2)


def flash_supported(head_dim: int) -> bool:
    """The native attention kernel's 4x16 register tiles need head_dim a multiple of 16 (whole GQA
    groups are checked by attention() for every backend)."""
    return head_dim % 16 == 0


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, T, H, D] contiguous, lse [B, H, T]) for q [B, H, T, D], k, v [B, Hkv, S, D]."""
    q, k, v = _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v)
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    o, lse = torch.empty(b, t, h, d), torch.empty(b, h, t)
    library().mf_flash_fwd(
        _ptr(q),
        _ptr(k),
        _ptr(v),
        _ptr(o),
        _ptr(lse),
        b,
        h,
        hk,
        t,
        s,
        d,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        scale,
        int(causal),
        _threads(),
    )
    return o, lse


def flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) as [B, H, T, D] / [B, Hkv, S, D] views of [B, T, H, D] / [B, S, Hkv, D] storage."""
    q, k, v, do = (_last_dim_dense(x) for x in (q, k, v, do))
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty(b, t, h, d), torch.empty(b, s, hk, d), torch.empty(b, s, hk, d)
    library().mf_flash_bwd(
        _ptr(q),
        _ptr(k),
        _ptr(v),
        _ptr(o),
        _ptr(lse),
        _ptr(do),
        _ptr(dq),
        _ptr(dk),
        _ptr(dv),
        b,
        h,
        hk,
        t,
        s,
        d,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *do.stride()[:3],
        scale,
        int(causal),
        _threads(),
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
