"""The CUDA C kernels of kernels/csrc/ (no headers, no C++ bindings): compiled once per GPU architecture with NVRTC
when its library is found (in-process, about a second) or else with `nvcc -cubin` (a few seconds), the cubin cached
under ${XDG_CACHE_HOME:-~/.cache}/dsv41/kernels/ by the source's hash, loaded and launched through the CUDA driver
API on the current torch stream (so CUDA graphs capture the launches like any other).

    from kernels import cuda
    fn = cuda.function("decode.cu", "fp8_linear_split_t1")      # None when no compiler or GPU is there
    cuda.launch(fn, grid, block, [tensor_or_int_or_float, ...])

`available()` says whether the kernels can be used here (a CUDA device of compute capability >= 8.0 and a compiler);
callers fall back to the Triton kernels otherwise.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()
_modules: dict[tuple[str, int], ctypes.c_void_p] = {}
_functions: dict[tuple[str, str, int], ctypes.c_void_p] = {}
_libs: dict[str, ctypes.CDLL | None] = {}


class CudaKernelError(RuntimeError):
    pass


def _lib(name: str, patterns: list[str]) -> ctypes.CDLL | None:
    if name in _libs:
        return _libs[name]
    found = None
    cands = [ctypes.util.find_library(name)] + [p for pat in patterns for p in sorted(glob.glob(pat), reverse=True)]
    for c in cands:
        if not c:
            continue
        try:
            found = ctypes.CDLL(c)
            break
        except OSError:
            continue
    _libs[name] = found
    return found


def _cuda() -> ctypes.CDLL | None:
    return _lib("cuda", ["/usr/lib/x86_64-linux-gnu/libcuda.so*", "/usr/local/nvidia/lib64/libcuda.so*",
                         "/usr/lib64/libcuda.so*"])


def _nvrtc() -> ctypes.CDLL | None:
    site = [os.path.dirname(os.path.dirname(torch.__file__))] + [p for p in sys.path if p.endswith("site-packages")]
    pats = [f"{s}/nvidia/*/lib/libnvrtc.so*" for s in site] + [f"{s}/nvidia/cuda_nvrtc/lib/libnvrtc.so*" for s in site]
    pats += ["/usr/local/cuda*/lib64/libnvrtc.so*", "/usr/local/cuda*/targets/*/lib/libnvrtc.so*"]
    return _lib("nvrtc", [p for p in pats if "builtins" not in p])


def _check(err: int, what: str) -> None:
    if err != 0:
        cu = _cuda()
        msg = ctypes.c_char_p()
        if cu is not None:
            cu.cuGetErrorString(err, ctypes.byref(msg))
        raise CudaKernelError(f"{what} failed: CUDA error {err} ({(msg.value or b'').decode()})")


def _arch(device: int) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "dsv41" / "kernels"


def _compile_nvrtc(src: str, name: str, arch: int) -> bytes | None:
    lib = _nvrtc()
    if lib is None:
        return None
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) != 0:
        return None
    opts = [f"--gpu-architecture=sm_{arch}".encode(), b"--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    if rc != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise CudaKernelError(f"NVRTC could not compile {name}:\n{log.value.decode(errors='replace')}")
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0 or size.value == 0:
        return None
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


def _compile_nvcc(src: str, path: Path, arch: int) -> bytes | None:
    nvcc = shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)), None)
    if nvcc is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "k.cubin"
        code = Path(d) / path.name                 # the source as given (with its defines); csrc files include nothing
        code.write_text(src)
        r = subprocess.run([nvcc, "-cubin", f"-arch=sm_{arch}", "-O3", "-o", str(out), str(code)],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise CudaKernelError(f"nvcc could not compile {path.name}:\n{r.stderr}")
        return out.read_bytes()


def cubin(source: str, arch: int) -> bytes:
    """The compiled cubin of csrc/`source` for sm_`arch` (cached by the source's hash). `source` may name macros
    after '#' ("exl3.cu#EXL3_BENCH_FORMS"): the file compiled with each `#define NAME 1` first, a module of its
    own (bench-only kernels kept out of the served module's compile)."""
    base, *defines = source.split("#")
    path = CSRC / base
    src = "".join(f"#define {d} 1\n" for d in defines) + path.read_text()
    key = hashlib.sha256(src.encode() + str(arch).encode()).hexdigest()[:24]
    cache = _cache_dir() / f"{path.stem}-sm{arch}-{key}.cubin"
    if cache.is_file():
        return cache.read_bytes()
    img = _compile_nvrtc(src, base, arch) or _compile_nvcc(src, path, arch)
    if img is None:
        raise CudaKernelError("no CUDA compiler found (NVRTC library or nvcc)")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(img)
        tmp.replace(cache)
    except OSError:
        pass
    return img


def _ensure_context(device: int) -> None:
    """The device's primary context current in this thread (torch's runtime calls use the same one)."""
    cu = _cuda()
    ctx = ctypes.c_void_p()
    _check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        torch.cuda.set_device(device)
        torch.cuda.current_stream(device)        # makes the runtime's primary context current
        dev = ctypes.c_int()
        _check(cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


# Every kernel of each source, resolved when its module loads: the first launch of a kernel may come inside a CUDA
# graph capture, where loading a module (and perhaps resolving a function) must not happen.
KERNELS = {"decode.cu": [f"{k}_linear_{m}_t{t}" for k in ("fp8", "bf16") for m in ("split", "whole")
                         for t in (1, 2, 4, 8)]
           + [f"moe_{p}_t{t}" for p in ("up", "down") for t in (1, 2, 4, 8)] + ["pack_x", "work_list_small"],
           "exl3.cu": [f"exl3_k{k}_cb{c}_t1" for k in (2, 4, 6, 8, 10, 12, 14, 16) for c in (0, 1, 2)]
           + [f"exl3_k{k}_cb2_t{t}" for k in (3, 5, 7) for t in (1, 8)]
           + [f"exl3_k{k}_cb2_t8" for k in (2, 4, 6, 8, 10, 12, 14, 16)] + ["exl3_k8_cb0_t8", "exl3_k8_cb1_t8"]
           + ["exl3_k5_cb2_t4", "exl3_k8_cb0_t4", "exl3_k8_cb2_t4"]
           + [f"exl3w_k{k}_cb{c}_t1" for k, c in ((5, 2), (8, 0), (8, 2))]}


def function(source: str, name: str, device: int | None = None) -> ctypes.c_void_p:
    """The CUfunction `name` of csrc/`source` on `device` (the module compiled and loaded on first use, every kernel
    of KERNELS resolved then)."""
    device = torch.cuda.current_device() if device is None else device
    key = (source, name, device)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is not None:
            return fn
        cu = _cuda()
        if cu is None:
            raise CudaKernelError("libcuda not found")
        torch.cuda.init()
        _check(cu.cuInit(0), "cuInit")
        _ensure_context(device)
        mkey = (source, device)
        mod = _modules.get(mkey)
        if mod is None:
            img = cubin(source, _arch(device))
            mod = ctypes.c_void_p()
            _check(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(img)), f"loading {source}")
            _modules[mkey] = mod
            for other in KERNELS.get(source, []):
                f = ctypes.c_void_p()
                _check(cu.cuModuleGetFunction(ctypes.byref(f), mod, other.encode()), f"finding {other} in {source}")
                _functions[(source, other, device)] = f
            fn = _functions.get(key)
            if fn is not None:
                return fn
        fn = ctypes.c_void_p()
        _check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), f"finding {name} in {source}")
        _functions[key] = fn
        return fn


class _LaunchAttribute(ctypes.Structure):          # CUlaunchAttribute: an id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):             # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("nattrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6             # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def launch(fn: ctypes.c_void_p, grid: tuple[int, int, int], block: int, args: list, pdl: bool = False) -> None:
    """Launch fn on the current torch stream. args: tensors (their data pointers), Python ints (int32) and floats
    (float32), in the kernel's parameter order. pdl: a programmatic dependent launch (the kernel may start while
    the stream's previous kernel finishes; it must wait (griddepcontrol.wait) before reading what that wrote)."""
    vals = []
    for a in args:
        if isinstance(a, torch.Tensor):
            vals.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, (bool, int)):
            vals.append(ctypes.c_int(int(a)))
        elif isinstance(a, float):
            vals.append(ctypes.c_float(a))
        elif a is None:
            vals.append(ctypes.c_void_p(0))
        else:
            raise TypeError(f"kernel argument of type {type(a).__name__}")
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    stream = torch.cuda.current_stream().cuda_stream
    cu = _cuda()
    if pdl:
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value = (1).to_bytes(4, "little") + bytes(60)
        cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(block, 1, 1), shared=0,
                            stream=ctypes.c_void_p(stream), attrs=ctypes.pointer(attr), nattrs=1)
        _check(cu.cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None), "cuLaunchKernelEx")
        return
    rc = cu.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1, 0, ctypes.c_void_p(stream), params, None)
    if rc != 0:
        _ensure_context(torch.cuda.current_device())
        rc = cu.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1, 0, ctypes.c_void_p(stream), params, None)
    _check(rc, "cuLaunchKernel")


_available: dict[int, bool] = {}


def available(device: int | None = None) -> bool:
    """Whether the CUDA C kernels run here: a CUDA device of compute capability >= 8.0, libcuda, and the kernels
    compile (checked once per device)."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    device = torch.cuda.current_device() if device is None else device
    if device not in _available:
        try:
            ok = _arch(device) >= 80 and _cuda() is not None
            if ok:
                function("decode.cu", "fp8_linear_split_t1", device)
                from kernels.fp8_linear import _counter
                _counter(torch.device("cuda", device), 1)      # the arrival counters, outside any graph capture
        except (CudaKernelError, OSError) as exc:
            print(f"kernels/cuda.py: the CUDA C kernels are not used ({exc})", file=sys.stderr)
            ok = False
        _available[device] = ok
    return _available[device]
