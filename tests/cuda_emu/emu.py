"""emu.py: the Python side of the CUDA emulator (libcudaemu.so, built by
scripts/emulate-cuda-kernels.sh): launching kernels by name, device-like buffers, and the check
report.

- `Emu.launch(name, grid, block, *args)` passes each argument as cuLaunchKernel does (a pointer
  to its value) with its type spelled out: a `Buf` (or None) is a pointer, `i32(v)`, `i64(v)`,
  `f32(v)` the scalars. The library checks the types against the kernel's own signature. A
  launch that the emulator rejects (deadlock, divergent barrier, ...) or that wrote outside one
  of its buffers raises `EmuError`.
- `Buf` is memory at a chosen byte offset from a 64-byte boundary (alignment matters to the
  kernels) with guard bytes on both sides that must survive every launch. Under
  OATO_CUDA_EMU_SAN=1 (AddressSanitizer preloaded) buffers are exact-size allocations with the
  bytes before them poisoned, so any read outside aborts with ASan's report.
- `Report` / `Group`: checks are grouped (one group per kernel, mostly); each check states its
  metric, tolerance and where its worst error is. One line per group is printed, each failing
  check below it (every check with -v), then "cuda-emu: N passed, N failed".
"""

import ctypes
import os
import re
import traceback
import zlib

import numpy as np

SAN = os.environ.get("OATO_CUDA_EMU_SAN") == "1"
GUARD = 64
GUARD_BYTE = 0xA5


class EmuError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Scalars and buffers


class Scalar:
    def __init__(self, code, cvalue):
        self.code, self.cvalue = code, cvalue


def i32(v):
    return Scalar("i", ctypes.c_int32(int(v)))


def i64(v):
    return Scalar("l", ctypes.c_int64(int(v)))


def f32(v):
    return Scalar("f", ctypes.c_float(float(v)))


if SAN:
    _libc = ctypes.CDLL(None)
    _libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                     ctypes.c_size_t]
    _libc.free.argtypes = [ctypes.c_void_p]
    _poison = _libc.__asan_poison_memory_region
    _unpoison = _libc.__asan_unpoison_memory_region
    _poison.argtypes = _unpoison.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class Buf:
    """`nbytes` of memory starting `off` bytes past a 64-byte boundary."""

    def __init__(self, nbytes, off=0, fill=None):
        assert 0 <= off < 64
        self.nbytes, self.off = nbytes, off
        if SAN:
            p = ctypes.c_void_p()
            if _libc.posix_memalign(ctypes.byref(p), 64, off + max(nbytes, 1)) != 0:
                raise MemoryError(nbytes)
            self._raw = p.value
            self.ptr = p.value + off
            if off:
                _poison(p.value, off)
            mem = (ctypes.c_uint8 * max(nbytes, 1)).from_address(self.ptr)
            self.u8 = np.ctypeslib.as_array(mem)[:nbytes]
        else:
            # >= GUARD bytes before and after, whatever the alignment padding and offset.
            self._raw = np.full(nbytes + 2 * GUARD + 128, GUARD_BYTE, np.uint8)
            start = GUARD + (-(self._raw.ctypes.data + GUARD) % 64) + off
            self._start = start
            self.u8 = self._raw[start:start + nbytes]
            self.ptr = self._raw.ctypes.data + start
        if fill is not None:
            self.u8[:] = fill

    def __del__(self):
        if SAN and getattr(self, "_raw", None):
            if self.off:
                _unpoison(self._raw, self.off)
            _libc.free(self._raw)
            self._raw = None

    @classmethod
    def of(cls, arr, off=0):
        """A buffer holding a copy of `arr`'s bytes."""
        a = np.ascontiguousarray(arr)
        b = cls(a.nbytes, off)
        b.u8[:] = a.reshape(-1).view(np.uint8)
        return b

    @classmethod
    def out(cls, dtype, count, off=0):
        """An output buffer of `count` elements filled with 0xFF bytes (NaN for f32 and f16), so
        an element the kernel fails to write shows."""
        return cls(np.dtype(dtype).itemsize * count, off, fill=0xFF)

    def get(self, dtype):
        return self.u8.view(dtype).copy()

    def guards_broken(self):
        """Where bytes around the buffer changed, as text, or None."""
        if SAN:
            return None
        before = self._raw[:self._start]
        after = self._raw[self._start + self.nbytes:]
        bad_b = np.flatnonzero(before != GUARD_BYTE)
        bad_a = np.flatnonzero(after != GUARD_BYTE)
        if bad_b.size == 0 and bad_a.size == 0:
            return None
        parts = []
        if bad_b.size:
            parts.append(f"{bad_b.size} byte(s) before the start (from {bad_b[0] - before.size})")
        if bad_a.size:
            parts.append(f"{bad_a.size} byte(s) after the end (from +{bad_a[0]})")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# The library


class Emu:
    def __init__(self, path):
        self.lib = lib = ctypes.CDLL(os.path.abspath(path))
        lib.emu_kernel_count.restype = ctypes.c_int
        for f in ("emu_kernel_name", "emu_kernel_source", "emu_kernel_signature"):
            getattr(lib, f).restype = ctypes.c_char_p
            getattr(lib, f).argtypes = [ctypes.c_int]
        lib.emu_last_error.restype = ctypes.c_char_p
        u3 = ctypes.c_uint * 3
        lib.emu_launch.argtypes = [ctypes.c_char_p, u3, u3, ctypes.c_char_p,
                                   ctypes.POINTER(ctypes.c_void_p)]
        lib.emu_launch.restype = ctypes.c_int
        self.kernels = {}  # name -> (source file, signature)
        for i in range(lib.emu_kernel_count()):
            self.kernels[lib.emu_kernel_name(i).decode()] = (
                lib.emu_kernel_source(i).decode(), lib.emu_kernel_signature(i).decode())
        self.launched = set()

    def launch(self, name, grid, block, *args):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        codes, keep = [], []
        params = (ctypes.c_void_p * max(len(args), 1))()
        for i, a in enumerate(args):
            if isinstance(a, Buf) or a is None:
                v = ctypes.c_void_p(a.ptr if a is not None else 0)
                codes.append("p")
            elif isinstance(a, Scalar):
                v = a.cvalue
                codes.append(a.code)
            else:
                raise TypeError(f"{name} argument {i}: pass Buf, None, i32, i64 or f32, not {a!r}")
            keep.append(v)
            params[i] = ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
        self.launched.add(name)
        rc = self.lib.emu_launch(name.encode(), (ctypes.c_uint * 3)(*grid),
                                 (ctypes.c_uint * 3)(*block), "".join(codes).encode(), params)
        if rc != 0:
            raise EmuError(self.lib.emu_last_error().decode())
        for i, a in enumerate(args):
            if isinstance(a, Buf):
                broken = a.guards_broken()
                if broken:
                    raise EmuError(f"{name} wrote outside argument {i}: {broken}")


# ---------------------------------------------------------------------------------------------
# Data


def rng_for(label):
    """A generator seeded by the check's name: each check's data stays the same when others are
    added or removed."""
    return np.random.default_rng(zlib.crc32(label.encode()))


def cos_pattern(n, offset=0.0):
    """ggml's test pattern 0.1 + 2 cos(i + offset)."""
    return (0.1 + 2.0 * np.cos(np.arange(n, dtype=np.float64) + offset)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Report


def _where(idx, shape, dims):
    if dims is None:
        return f"[{idx}]"
    pos = np.unravel_index(idx, shape)
    return "(" + ", ".join(f"{d}={int(p)}" for d, p in zip(dims, pos)) + ")"


class Check:
    def __init__(self, label, kind):
        self.label, self.kind, self.ok, self.detail = label, kind, True, ""
        self.ratio = 0.0  # worst error / tolerance, for the group line


class Group:
    def __init__(self, name):
        self.name, self.checks = name, []

    def _add(self, c):
        self.checks.append(c)
        return c.ok

    def exact(self, label, got, want, dims=None):
        """Bit-for-bit equality (compared as unsigned integers of the element size)."""
        c = Check(label, "exact")
        got, want = np.asarray(got), np.asarray(want)
        if want.dtype != got.dtype:
            want = want.astype(got.dtype)
        if got.shape != want.shape:
            c.ok, c.detail = False, f"shape {got.shape}, want {want.shape}"
            return self._add(c)
        ut = np.dtype(f"u{got.dtype.itemsize}")
        g, w = got.reshape(-1).view(ut), want.reshape(-1).view(ut)
        bad = np.flatnonzero(g != w)
        if bad.size:
            i = bad[0]
            c.ok = False
            c.detail = (f"{bad.size}/{g.size} differ, first at {_where(i, got.shape, dims)}: got "
                        f"{got.reshape(-1)[i]!r} ({int(g[i]):#x}), want {want.reshape(-1)[i]!r} "
                        f"({int(w[i]):#x})")
            c.ratio = float("inf")
        else:
            c.detail = f"bit-exact, {g.size} values"
        return self._add(c)

    def close(self, label, got, want, tol, scale=1.0, dims=None, metric="err"):
        """max |got - want| / scale <= tol, everything finite; `scale` broadcasts to want."""
        c = Check(label, "close")
        got = np.asarray(got, np.float64)
        want = np.asarray(want, np.float64)
        if got.shape != want.shape:
            c.ok, c.detail = False, f"shape {got.shape}, want {want.shape}"
            return self._add(c)
        err = np.abs(got - want) / np.broadcast_to(np.asarray(scale, np.float64), want.shape)
        err = np.where(np.isfinite(got), err, np.inf).reshape(-1)
        i = int(np.argmax(err)) if err.size else 0
        worst = float(err[i]) if err.size else 0.0
        c.ok = worst <= tol
        c.ratio = worst / tol
        c.detail = f"max {metric} {worst:.2e} at {_where(i, got.shape, dims)} (tol {tol:.0e})"
        if not np.isfinite(got.reshape(-1)[i]):
            c.detail += f": got {got.reshape(-1)[i]}"
        return self._add(c)

    def true(self, label, cond, detail=""):
        c = Check(label, "true")
        c.ok, c.detail = bool(cond), detail
        c.ratio = 0.0 if c.ok else float("inf")
        return self._add(c)

    def error(self, label, exc):
        c = Check(label, "error")
        c.ok, c.ratio = False, float("inf")
        c.detail = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, EmuError):
            c.detail += "\n" + traceback.format_exc(limit=-3)
        return self._add(c)


class Report:
    def __init__(self, verbose=False, only=None):
        self.groups, self.verbose = [], verbose
        self.only = re.compile(only) if only else None

    def run(self, name, fn, *args):
        """Runs fn(group, *args); an exception fails the group's current check. With `only` (a
        regular expression), groups whose names it does not match are skipped."""
        if self.only and not self.only.search(name):
            return None
        g = Group(name)
        try:
            fn(g, *args)
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            g.error("(raised)", e)
        self.groups.append(g)
        self.print_group(g)
        return g

    def print_group(self, g):
        failed = [c for c in g.checks if not c.ok]
        head = "ok  " if not failed and g.checks else "FAIL"
        n = len(g.checks)
        line = f"{head} {g.name:<18} {n:3d} check{'s' if n != 1 else ' '}"
        if failed:
            line += f", {len(failed)} failed"
        else:  # the worst tolerance check, else how many were bit-exact
            close = [c for c in g.checks if c.kind == "close"]
            n_exact = sum(c.kind == "exact" for c in g.checks)
            if close:
                worst = max(close, key=lambda c: c.ratio)
                line += f"  worst: {worst.label}: {worst.detail}"
                if n_exact:
                    line += f"; {n_exact} bit-exact"
            elif n_exact:
                line += f"  bit-exact{' (all)' if n_exact == n else f' ({n_exact})'}"
        print(line, flush=True)
        for c in g.checks:
            if not c.ok or self.verbose:
                print(f"    {'ok  ' if c.ok else 'FAIL'} {c.label}: {c.detail}", flush=True)

    def summary(self):
        checks = [c for g in self.groups for c in g.checks]
        failed = sum(not c.ok for c in checks)
        print(f"cuda-emu: {len(checks) - failed} passed, {failed} failed")
        return failed == 0 and len(checks) > 0
