//! The kernel sources (`kernels/*.cu`, one op per file), embedded in the binary, and the disk
//! cache of their compiled images.
//!
//! A source is compiled as `prelude.cuh` + the listed parts: no `#include`, so NVRTC needs no
//! include path and no CUDA headers at run time.

use std::path::PathBuf;

use crate::error::Result;
use crate::nvrtc::{Image, Nvrtc};

const PRELUDE: &str = include_str!("../kernels/prelude.cuh");
const DEQUANT: &str = include_str!("../kernels/dequant.cuh");
const MMA: &str = include_str!("../kernels/mma.cuh");
const Q8: &str = include_str!("../kernels/q8.cuh");
const ATTN: &str = include_str!("../kernels/attention.cuh");
const MOE_H: &str = include_str!("../kernels/moe.cuh");
const MMA8: &str = include_str!("../kernels/mma8.cuh");
const ASYNC: &str = include_str!("../kernels/async.cuh");
const NORM: &str = include_str!("../kernels/norm.cuh");
const WGMMA_H: &str = include_str!("../kernels/wgmma.cuh");
const ATTN_TILE: &str = include_str!("../kernels/attention_tile.cuh");
const ROUTE_H: &str = include_str!("../kernels/route.cuh");
const KV_STORE: &str = include_str!("../kernels/kv_store.cuh");

/// One compilation unit: an op's `.cu` file and the shared parts it needs.
#[derive(Debug)]
pub struct Kernel {
    pub name: &'static str,
    parts: &'static [&'static str],
    /// Compiled for the arch-specific target (`sm_90a`, which wgmma needs) on a GPU of compute
    /// capability 9.0; for the plain target elsewhere (its sources guard what needs it).
    pub arch_specific: bool,
}

impl Kernel {
    /// The full source NVRTC compiles.
    pub fn source(&self) -> String {
        let mut s = String::from(PRELUDE);
        for p in self.parts {
            s.push('\n');
            s.push_str(p);
        }
        s
    }
}

macro_rules! kernel {
    ($id:ident, $name:literal $(, $part:expr)*) => {
        pub static $id: Kernel =
            Kernel { name: $name, parts: &[$($part,)* include_str!(concat!("../kernels/", $name, ".cu"))], arch_specific: false };
    };
}

/// A [`kernel!`] compiled for `sm_90a` on compute capability 9.0 ([`Kernel::arch_specific`]).
macro_rules! kernel_90a {
    ($id:ident, $name:literal $(, $part:expr)*) => {
        pub static $id: Kernel =
            Kernel { name: $name, parts: &[$($part,)* include_str!(concat!("../kernels/", $name, ".cu"))], arch_specific: true };
    };
}

kernel!(MATMUL, "matmul", DEQUANT, MMA);
kernel!(GEMV_Q8, "gemv_q8", DEQUANT, Q8);
kernel!(GET_ROWS, "get_rows", DEQUANT);
kernel!(Q6_REPACK, "q6_repack");
kernel!(RMS_NORM, "rms_norm", NORM);
kernel!(ADD, "add");
kernel!(GATE, "gate");
kernel!(SELECT_ROWS, "select_rows");
kernel!(TOP_K, "top_k");
kernel!(ROUTE, "route", ROUTE_H);
kernel!(MOE_ROUTE, "moe_route", NORM, ROUTE_H);
kernel!(ATTN_PREP, "attn_prep", KV_STORE);
kernel!(DELTA_PREP, "delta_prep");
kernel!(CONV1D_SILU, "conv1d_silu");
kernel!(DELTA_RULE, "delta_rule", NORM);
kernel!(DELTA_CHUNKED, "delta_chunked");
kernel!(MOE, "moe", DEQUANT, MMA, Q8, MOE_H, ROUTE_H);
kernel!(MOE_MMA8, "moe_mma8", DEQUANT, MOE_H, MMA8);
kernel!(MATMUL_MMA8, "matmul_mma8", DEQUANT, MMA8);
kernel!(MOE_SHARED, "moe_shared");
kernel!(MAILBOX, "mailbox");
kernel!(KV_APPEND, "kv_append", KV_STORE);
kernel!(ATTENTION, "attention", ATTN);
kernel!(ATTENTION_DECODE, "attention_decode", ATTN);
kernel_90a!(ATTENTION_PREFILL, "attention_prefill", DEQUANT, MMA, ASYNC, WGMMA_H, ATTN, ATTN_TILE);
kernel_90a!(ATTENTION_WG, "attention_wg", DEQUANT, MMA, ASYNC, WGMMA_H, ATTN, ATTN_TILE);
kernel!(ATTENTION_DECODE_MMA, "attention_decode_mma", DEQUANT, MMA, ASYNC, ATTN);
kernel_90a!(WGMMA, "wgmma", DEQUANT, MMA, ASYNC, WGMMA_H);

/// Every kernel source (the NVRTC compile test walks this).
pub static ALL: &[&Kernel] = &[
    &MATMUL,
    &GEMV_Q8,
    &GET_ROWS,
    &Q6_REPACK,
    &RMS_NORM,
    &ADD,
    &GATE,
    &SELECT_ROWS,
    &TOP_K,
    &ROUTE,
    &MOE_ROUTE,
    &ATTN_PREP,
    &DELTA_PREP,
    &CONV1D_SILU,
    &DELTA_RULE,
    &DELTA_CHUNKED,
    &MOE,
    &MOE_MMA8,
    &MATMUL_MMA8,
    &MOE_SHARED,
    &MAILBOX,
    &KV_APPEND,
    &ATTENTION,
    &ATTENTION_DECODE,
    &ATTENTION_PREFILL,
    &ATTENTION_WG,
    &ATTENTION_DECODE_MMA,
    &WGMMA,
];

/// NVRTC options for every kernel. No `--use_fast_math`: the kernels are checked against the
/// scalar reference, and fast `expf`/division would widen every tolerance.
pub const OPTIONS: &[&str] = &["-std=c++17", "--fmad=true"];

/// `$XDG_CACHE_HOME/ember/kernels` or `~/.cache/ember/kernels`; `EMBER_KERNEL_CACHE` overrides.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("EMBER_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("ember").join("kernels"))
}

/// `#define NAME 1` lines for the names in `EMBER_KERNEL_DEFINES` (comma-separated; letters,
/// digits and `_` only): compile-time switches of the kernels for A/B runs, e.g.
/// `EMBER_MMA_F32_DECODE` (the tensor-core tiles decode K-quants in f32, as before the f16x2
/// decoders). The cache key covers them, since they are part of the source.
fn defines_from_env() -> String {
    define_names().into_iter().map(|n| format!("#define {n} 1\n")).collect()
}

/// The names in `EMBER_KERNEL_DEFINES` (see [`defines_from_env`]).
fn define_names() -> Vec<String> {
    let Some(v) = std::env::var_os("EMBER_KERNEL_DEFINES") else { return Vec::new() };
    v.to_string_lossy()
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .map(str::to_owned)
        .collect()
}

/// Whether `EMBER_KERNEL_DEFINES` names `name` now: for a switch whose host side must follow
/// its kernels (read when a [`crate::Gpu`] opens, as its kernels compile with the same value).
pub(crate) fn defined(name: &str) -> bool {
    define_names().iter().any(|n| n == name)
}

/// 128-bit FNV-1a: stable across Rust releases (std's hasher is not promised to be), and a cache
/// key needs no more.
fn fnv128(parts: &[&[u8]]) -> u128 {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for p in parts {
        for &b in p.iter().chain(&[0xff]) {
            h ^= b as u128;
            h = h.wrapping_mul(0x0000000001000000000000000000013B);
        }
    }
    h
}

/// The image of `kernel` for compute capability `cc`: from the disk cache if there, else
/// compiled and stored (a cache that cannot be written is skipped, not an error).
/// The key covers the source, the options, the NVRTC version and the architecture.
pub fn load_or_compile(nvrtc: &Nvrtc, kernel: &'static Kernel, cc: u32) -> Result<Image> {
    let src = defines_from_env() + &kernel.source();
    let (maj, min) = nvrtc.version();
    let a = if kernel.arch_specific && cc == 90 { "a" } else { "" };
    let key = fnv128(&[src.as_bytes(), OPTIONS.join(" ").as_bytes(), format!("nvrtc {maj}.{min} sm_{cc}{a}").as_bytes()]);
    let dir = cache_dir();
    let stem = format!("{}-sm{cc}{a}-{key:032x}", kernel.name);
    if let Some(d) = &dir {
        if let Ok(b) = std::fs::read(d.join(format!("{stem}.cubin"))) {
            return Ok(Image::Cubin(b));
        }
        if let Ok(s) = std::fs::read_to_string(d.join(format!("{stem}.ptx"))) {
            return Ok(Image::Ptx(s));
        }
    }
    let image = nvrtc.compile_kernel(kernel, &src, cc, OPTIONS)?;
    if let Some(d) = &dir {
        let (ext, bytes) = match &image {
            Image::Cubin(b) => ("cubin", b.as_slice()),
            Image::Ptx(s) => ("ptx", s.as_bytes()),
        };
        // Write then rename, so a concurrent reader never sees half a file.
        let tmp = d.join(format!("{stem}.{}.tmp", std::process::id()));
        let ok = std::fs::create_dir_all(d).is_ok() && std::fs::write(&tmp, bytes).is_ok();
        if !ok || std::fs::rename(&tmp, d.join(format!("{stem}.{ext}"))).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(image)
}
