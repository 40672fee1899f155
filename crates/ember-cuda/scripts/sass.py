#!/usr/bin/env python3
"""What a kernel costs in code, with no GPU: each entry's registers, spills, shared memory and
SASS instruction count for an architecture (default sm_90), from the same source ember compiles.

    crates/ember-cuda/scripts/sass.py attention [ENTRY_SUBSTRING] [--arch 90] [--sass]

The source is prelude.cuh + the parts that `kernel!` lists in src/kernels.rs + kernels/NAME.cu,
compiled to PTX by NVRTC with ember's options (the PyPI `nvidia-cuda-nvrtc` wheel that CI
installs), then to SASS by ptxas and read back by nvdisasm. ptxas and nvdisasm come from the
PyPI wheels `nvidia-cuda-nvcc` and `nvidia-cuda-nvdisasm` of NVRTC's version (the PTX NVRTC
writes is too new for an older ptxas); they are fetched once into ~/.cache/ember/cuda-tools
(EMBER_CUDA_TOOLS overrides) with `pip download`. --sass writes the listing beside the counts.

Found with it (2026-12-05): attention_decode's 8-head instance was ~5,000 instructions, the
1-head one ~1,100 (docs/perf.md, GPU g10).
"""
import ctypes
import glob
import os
import re
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
CRATE = os.path.dirname(HERE)
OPTIONS = [b"-std=c++17", b"--fmad=true"]  # kernels.rs OPTIONS


def nvrtc():
    import nvidia  # the nvidia-cuda-nvrtc wheel

    for root in nvidia.__path__:
        for lib in sorted(glob.glob(os.path.join(root, "cu*", "lib", "libnvrtc.so.*"))):
            if "builtins" not in lib:
                return ctypes.CDLL(lib)
    sys.exit("no libnvrtc in the nvidia wheels: pip install nvidia-cuda-nvrtc")


def nvrtc_version(lib):
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def tools(version):
    """ptxas and nvdisasm of NVRTC's major.minor, from the PyPI wheels (fetched once)."""
    root = os.environ.get("EMBER_CUDA_TOOLS") or os.path.expanduser(f"~/.cache/ember/cuda-tools/{version[0]}.{version[1]}")
    found = {}
    for name in ("ptxas", "nvdisasm"):
        hits = glob.glob(os.path.join(root, "**", "bin", name), recursive=True)
        if hits:
            found[name] = hits[0]
    if len(found) == 2:
        return found["ptxas"], found["nvdisasm"]
    os.makedirs(root, exist_ok=True)
    spec = f"=={version[0]}.{version[1]}.*"
    for wheel in ("nvidia-cuda-nvcc", "nvidia-cuda-nvdisasm"):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", root, wheel + spec], check=True)
    for whl in glob.glob(os.path.join(root, "*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(root)
    for name in ("ptxas", "nvdisasm"):
        path = glob.glob(os.path.join(root, "**", "bin", name), recursive=True)[0]
        os.chmod(path, 0o755)
        found[name] = path
    return found["ptxas"], found["nvdisasm"]


def source(name):
    """The text NVRTC compiles for kernel `name` (kernels.rs: prelude + listed parts + NAME.cu)."""
    rs = open(os.path.join(CRATE, "src", "kernels.rs")).read()
    m = re.search(r'kernel(?:_90a)?!\(\w+, "' + re.escape(name) + r'"((?:, \w+)*)\);', rs)
    if not m:
        sys.exit(f"no kernel!(.., \"{name}\", ..) in src/kernels.rs")
    # The shared parts: `const NAME: &str = include_str!("../kernels/FILE");`
    files = dict(re.findall(r'const (\w+): &str = include_str!\("\.\./kernels/([\w.]+)"\);', rs))
    parts = ["prelude.cuh"] + [files[p.strip()] for p in m.group(1).split(",") if p.strip()] + [name + ".cu"]
    # EMBER_KERNEL_DEFINES=A,B: the switches' `#define`s first, as kernels.rs adds them.
    defines = "".join(f"#define {d.strip()} 1\n" for d in os.environ.get("EMBER_KERNEL_DEFINES", "").split(",") if d.strip())
    return defines + "\n".join(open(os.path.join(CRATE, "kernels", p)).read() for p in parts)


def ptx(lib, name, arch):
    prog = ctypes.c_void_p()
    src = source(name).encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, (name + ".cu").encode(), 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture=compute_{arch}".encode()] + OPTIONS
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(log.value.decode())
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, out)
    return out.value


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="a kernel source of src/kernels.rs, e.g. attention")
    ap.add_argument("entry", nargs="?", default="", help="only entries whose name holds this")
    ap.add_argument("--arch", default="90", help="compute capability, e.g. 86 (default 90)")
    ap.add_argument("--sass", action="store_true", help="also write the SASS listing")
    a = ap.parse_args()
    name, want, arch = a.name, a.entry, a.arch
    lib = nvrtc()
    ptxas, nvdisasm = tools(nvrtc_version(lib))
    work = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ember-sass-{name}-sm{arch}")
    os.makedirs(work, exist_ok=True)
    ptx_path, cubin = os.path.join(work, name + ".ptx"), os.path.join(work, name + ".cubin")
    open(ptx_path, "wb").write(ptx(lib, name, arch))
    info = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", ptx_path, "-o", cubin], capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    # Instructions per entry: the lines with an address comment inside each .text.<entry> section.
    counts, entry = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*\.text\.(\w+):", line)
        if m:
            entry = m.group(1)
            counts[entry] = 0
        elif entry and re.search(r"/\*[0-9a-f]{4,}\*/", line):
            counts[entry] += 1
    regs, entry = {}, None
    for line in info.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            entry = m.group(1)
        elif entry and "spill" in line:
            regs.setdefault(entry, []).append(re.sub(r"\s+", " ", line.split(":")[-1].strip()))
        elif entry and "registers" in line:
            regs.setdefault(entry, []).append(re.sub(r"\s+", " ", line.split(":", 1)[-1].strip()))
    print(f"{name}.cu for sm_{arch} (NVRTC {'.'.join(map(str, nvrtc_version(lib)))})")
    for e in sorted(counts):
        if want in e:
            print(f"  {e}: {counts[e]} instructions; {'; '.join(regs.get(e, []))}")
    if a.sass:
        path = os.path.join(work, name + ".sass")
        open(path, "w").write(sass)
        print(f"  listing: {path}")


if __name__ == "__main__":
    main()
