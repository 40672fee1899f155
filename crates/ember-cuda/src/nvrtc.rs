//! Our own NVRTC loader and compiler front (shared/STACK.md, "NVRTC library location and
//! loading"). cudarc's loader panics when no library is found, takes no path and may map a
//! second copy of libnvrtc, so we pick the file ourselves:
//! 1. `EMBER_NVRTC=<file>`;
//! 2. the sonames `libnvrtc.so.13`, `libnvrtc.so.12` (newest first), skipping an NVRTC whose
//!    major version is above the driver's (its PTX and CUBINs would not load);
//! 3. the lib dirs of `$CUDA_HOME` / `$CUDA_PATH`;
//! 4. the pip wheel dirs (`nvidia/cu13/lib`, `nvidia/cuda_nvrtc/lib`) of the active Python,
//!    found through `$VIRTUAL_ENV` or one `python3 -c`.
//!
//! For a file in a directory, `libnvrtc-builtins.so.M.m` from the same directory is loaded
//! first with `RTLD_GLOBAL`: the pip wheel's libnvrtc has no RUNPATH and would not find it.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use libloading::Library;

use crate::error::{Error, Result};

type Prog = *mut c_void;
type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type FnCreate = unsafe extern "C" fn(*mut Prog, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> c_int;
type FnCompile = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
type FnSize = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
type FnGet = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
type FnDestroy = unsafe extern "C" fn(*mut Prog) -> c_int;
type FnErrStr = unsafe extern "C" fn(c_int) -> *const c_char;

/// `NVRTC_ERROR_INVALID_OPTION`: what NVRTC returns for an `--gpu-architecture` it lacks.
const NVRTC_ERROR_INVALID_OPTION: c_int = 5;

/// A loaded NVRTC. The function pointers stay valid while `_lib` (and `_builtins`) live.
pub struct Nvrtc {
    path: PathBuf,
    version: (u32, u32),
    create: FnCreate,
    compile: FnCompile,
    log_size: FnSize,
    log: FnGet,
    cubin_size: Option<FnSize>,
    cubin: Option<FnGet>,
    ptx_size: FnSize,
    ptx: FnGet,
    destroy: FnDestroy,
    err_str: FnErrStr,
    _lib: Library,
    _builtins: Option<Library>,
}

/// Compiled code: a CUBIN for one exact `sm_XX`, or PTX for the driver to JIT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    Cubin(Vec<u8>),
    Ptx(String),
}

impl Nvrtc {
    /// Finds and loads NVRTC (module doc for the order). `driver_major`: the driver's CUDA major
    /// version, if a driver is present; an NVRTC newer than that is skipped.
    pub fn load(driver_major: Option<u32>) -> Result<Nvrtc> {
        let mut tried = Vec::new();
        if let Some(p) = std::env::var_os("EMBER_NVRTC") {
            let p = PathBuf::from(p);
            // An explicit choice is taken as is, or fails: no silent fallback past it.
            return Self::open(&p, p.parent(), None)
                .map_err(|e| Error::Nvrtc { op: "load EMBER_NVRTC", msg: format!("{}: {e}", p.display()) });
        }
        for major in [13u32, 12] {
            if driver_major.is_some_and(|d| major > d) {
                continue;
            }
            let name = format!("libnvrtc.so.{major}");
            match Self::open(Path::new(&name), None, driver_major) {
                Ok(n) => return Ok(n),
                Err(e) => tried.push(format!("{name} ({e})")),
            }
        }
        for dir in candidate_dirs() {
            for major in [13u32, 12] {
                if driver_major.is_some_and(|d| major > d) {
                    continue;
                }
                let p = dir.join(format!("libnvrtc.so.{major}"));
                if !p.exists() {
                    continue;
                }
                match Self::open(&p, Some(&dir), driver_major) {
                    Ok(n) => return Ok(n),
                    Err(e) => tried.push(format!("{} ({e})", p.display())),
                }
            }
            tried.push(format!("{}/", dir.display()));
        }
        Err(Error::NoNvrtc { tried: tried.join(", ") })
    }

    /// Opens one file. `dir`: where to look for `libnvrtc-builtins.so.*` to preload.
    fn open(path: &Path, dir: Option<&Path>, driver_major: Option<u32>) -> std::result::Result<Nvrtc, String> {
        let builtins = match dir {
            Some(d) if !d.as_os_str().is_empty() => preload_builtins(d)?,
            _ => None,
        };
        // SAFETY: loading libnvrtc runs only its initialisers, which have no preconditions.
        let lib = unsafe { Library::new(path) }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the type is the symbol's C signature from nvrtc.h; the pointer is used
                // only while `lib` is alive (it is stored in the same struct).
                unsafe { lib.get::<_>(concat!($name, "\0").as_bytes()) }.map(|s| *s).map_err(|e| format!("{}: {e}", $name))
            };
        }
        let version: FnVersion = sym!("nvrtcVersion")?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints through valid pointers.
        unsafe { version(&mut major, &mut minor) };
        let v = (major as u32, minor as u32);
        if driver_major.is_some_and(|d| v.0 > d) {
            return Err(format!("NVRTC {}.{} is newer than the driver's CUDA {}", v.0, v.1, driver_major.unwrap_or(0)));
        }
        Ok(Nvrtc {
            path: path.to_path_buf(),
            version: v,
            create: sym!("nvrtcCreateProgram")?,
            compile: sym!("nvrtcCompileProgram")?,
            log_size: sym!("nvrtcGetProgramLogSize")?,
            log: sym!("nvrtcGetProgramLog")?,
            cubin_size: sym!("nvrtcGetCUBINSize").ok(),
            cubin: sym!("nvrtcGetCUBIN").ok(),
            ptx_size: sym!("nvrtcGetPTXSize")?,
            ptx: sym!("nvrtcGetPTX")?,
            destroy: sym!("nvrtcDestroyProgram")?,
            err_str: sym!("nvrtcGetErrorString")?,
            _lib: lib,
            _builtins: builtins,
        })
    }

    /// The file NVRTC was loaded from (a soname if the dynamic linker found it).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// (major, minor).
    pub fn version(&self) -> (u32, u32) {
        self.version
    }

    fn err(&self, code: c_int) -> String {
        // SAFETY: nvrtcGetErrorString returns a static C string for any code.
        let s = unsafe { CStr::from_ptr((self.err_str)(code)) };
        format!("{} ({code})", s.to_string_lossy())
    }

    /// [`Nvrtc::compile`] of `kernel`'s source `src` (the kernel's own, or with defines), for
    /// the arch-specific target `sm_90a` when the kernel asks for it and `cc` is 90 (a CUBIN, or
    /// PTX for `compute_90a`).
    pub fn compile_kernel(&self, kernel: &'static crate::kernels::Kernel, src: &str, cc: u32, options: &[&str]) -> Result<Image> {
        if !(kernel.arch_specific && cc == 90) {
            return self.compile(kernel.name, src, cc, options);
        }
        if self.cubin.is_some() {
            match self.compile_as(kernel.name, src, "sm_90a", options, true) {
                Err(Error::Nvrtc { msg, .. }) if msg.ends_with(&format!("({NVRTC_ERROR_INVALID_OPTION})")) => {}
                other => return other,
            }
        }
        self.compile_as(kernel.name, src, "compute_90a", options, false)
    }

    /// Compiles `src` for compute capability `cc` (e.g. 90): a CUBIN for `sm_{cc}`; PTX for the
    /// newest architecture NVRTC knows below it when it lacks `sm_{cc}` or CUBIN output.
    pub fn compile(&self, kernel: &'static str, src: &str, cc: u32, options: &[&str]) -> Result<Image> {
        if self.cubin.is_some() {
            match self.compile_as(kernel, src, &format!("sm_{cc}"), options, true) {
                Err(Error::Nvrtc { msg, .. }) if msg.ends_with(&format!("({NVRTC_ERROR_INVALID_OPTION})")) => {}
                other => return other,
            }
        }
        // No CUBIN for this GPU: PTX for the newest virtual arch we can name, JIT by the driver.
        let mut last = None;
        for arch in [cc, 90, 89, 86, 80, 75].into_iter().filter(|a| *a <= cc) {
            match self.compile_as(kernel, src, &format!("compute_{arch}"), options, false) {
                Err(e @ Error::Nvrtc { .. }) => last = Some(e),
                other => return other,
            }
        }
        Err(last.unwrap_or(Error::Nvrtc { op: "compile", msg: format!("no architecture at or below sm_{cc}") }))
    }

    fn compile_as(&self, kernel: &'static str, src: &str, arch: &str, options: &[&str], cubin: bool) -> Result<Image> {
        let csrc = CString::new(src).map_err(|_| Error::Nvrtc { op: "create", msg: "source has a NUL byte".into() })?;
        let cname = CString::new(format!("{kernel}.cu")).map_err(|_| Error::Nvrtc { op: "create", msg: "bad name".into() })?;
        let mut opts: Vec<CString> = vec![CString::new(format!("--gpu-architecture={arch}")).unwrap_or_default()];
        opts.extend(options.iter().filter_map(|o| CString::new(*o).ok()));
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings; no headers (count 0, null arrays).
        let rc = unsafe { (self.create)(&mut prog, csrc.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()) };
        if rc != 0 {
            return Err(Error::Nvrtc { op: "create", msg: self.err(rc) });
        }
        let prog = ProgGuard { prog, destroy: self.destroy };
        // SAFETY: `prog` is a live program; the option pointers outlive the call.
        let rc = unsafe { (self.compile)(prog.prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        if rc == NVRTC_ERROR_INVALID_OPTION {
            return Err(Error::Nvrtc { op: "compile", msg: self.err(rc) });
        }
        if rc != 0 {
            return Err(Error::Compile { kernel, arch: arch.to_string(), log: self.read(&prog, self.log_size, self.log)? });
        }
        if cubin && let (Some(size), Some(get)) = (self.cubin_size, self.cubin) {
            return Ok(Image::Cubin(self.read_bytes(&prog, size, get)?));
        }
        let mut ptx = self.read(&prog, self.ptx_size, self.ptx)?;
        while ptx.ends_with('\0') {
            ptx.pop();
        }
        Ok(Image::Ptx(ptx))
    }

    fn read_bytes(&self, prog: &ProgGuard, size: FnSize, get: FnGet) -> Result<Vec<u8>> {
        let mut n = 0usize;
        // SAFETY: live program, valid out pointer.
        let rc = unsafe { size(prog.prog, &mut n) };
        if rc != 0 {
            return Err(Error::Nvrtc { op: "output size", msg: self.err(rc) });
        }
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it will write.
        let rc = unsafe { get(prog.prog, buf.as_mut_ptr() as *mut c_char) };
        if rc != 0 {
            return Err(Error::Nvrtc { op: "output", msg: self.err(rc) });
        }
        Ok(buf)
    }

    fn read(&self, prog: &ProgGuard, size: FnSize, get: FnGet) -> Result<String> {
        let bytes = self.read_bytes(prog, size, get)?;
        Ok(String::from_utf8_lossy(&bytes).trim_end_matches('\0').to_string())
    }
}

/// Destroys the program on every exit path.
struct ProgGuard {
    prog: Prog,
    destroy: FnDestroy,
}

impl Drop for ProgGuard {
    fn drop(&mut self) {
        // SAFETY: `prog` came from nvrtcCreateProgram and is destroyed once, here.
        unsafe { (self.destroy)(&mut self.prog) };
    }
}

/// Loads `libnvrtc-builtins.so.M.m` from `dir` with RTLD_GLOBAL, if there is one.
fn preload_builtins(dir: &Path) -> std::result::Result<Option<Library>, String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(None) };
    let mut names: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnvrtc-builtins.so.")))
        .collect();
    names.sort();
    let Some(p) = names.pop() else { return Ok(None) };
    use libloading::os::unix::{Library as UnixLib, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading the builtins library runs only its initialisers.
    let lib = unsafe { UnixLib::open(Some(&p), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| format!("{}: {e}", p.display()))?;
    Ok(Some(lib.into()))
}

/// Directories of steps 3 and 4 of the search order.
fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            let root = PathBuf::from(root);
            for sub in ["lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"] {
                dirs.push(root.join(sub));
            }
        }
    }
    let mut site = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        let lib = PathBuf::from(venv).join("lib");
        if let Ok(entries) = std::fs::read_dir(&lib) {
            site.extend(entries.filter_map(|e| e.ok()).map(|e| e.path().join("site-packages")));
        }
    }
    if site.is_empty() {
        site.extend(python_site_dirs());
    }
    for s in site {
        dirs.push(s.join("nvidia/cu13/lib"));
        dirs.push(s.join("nvidia/cuda_nvrtc/lib"));
    }
    dirs.retain(|d| d.is_dir());
    dirs
}

/// The active python3's site-packages dirs (one short subprocess; none if there is no python3).
fn python_site_dirs() -> Vec<PathBuf> {
    let code = "import site,sys;print('\\n'.join(site.getsitepackages()+[site.getusersitepackages()]))";
    match std::process::Command::new("python3").args(["-c", code]).stderr(std::process::Stdio::null()).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).lines().map(PathBuf::from).collect(),
        _ => Vec::new(),
    }
}
