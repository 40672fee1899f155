//! Every kernel source compiles with NVRTC for sm_75, sm_86 and sm_90, with no GPU and no
//! driver: NVRTC only. Without NVRTC the test skips with a line saying why, unless `CI` is set
//! (CI installs it from PyPI: .ci/run), where a missing NVRTC fails.

use ember_cuda::kernels::{ALL, OPTIONS};
use ember_cuda::nvrtc::{Image, Nvrtc};

/// NVRTC, or None (after saying why) where it is missing and `CI` is not set.
fn nvrtc() -> Option<Nvrtc> {
    match Nvrtc::load(None) {
        Ok(n) => Some(n),
        Err(e) if std::env::var_os("CI").is_none() => {
            println!("skipped: {e}");
            None
        }
        Err(e) => panic!("CI is set and NVRTC is missing: {e}"),
    }
}

#[test]
fn every_kernel_compiles_for_sm75_sm86_sm90() {
    let Some(nvrtc) = nvrtc() else { return };
    println!("NVRTC {:?} from {}", nvrtc.version(), nvrtc.path().display());
    for kernel in ALL {
        for cc in [75, 86, 90] {
            let t = std::time::Instant::now();
            let image = nvrtc.compile_kernel(kernel, &kernel.source(), cc, OPTIONS).unwrap_or_else(|e| panic!("{e}"));
            let Image::Cubin(bytes) = image else { panic!("{} sm_{cc}: PTX instead of a CUBIN", kernel.name) };
            // An ELF image.
            assert_eq!(&bytes[..4], b"\x7fELF", "{} sm_{cc}", kernel.name);
            println!("{} sm_{cc}: {} bytes in {:.0} ms", kernel.name, bytes.len(), t.elapsed().as_secs_f64() * 1e3);
        }
    }
}

#[test]
fn a_compile_error_is_an_error_with_the_log() {
    let Ok(nvrtc) = Nvrtc::load(None) else {
        println!("skipped: no NVRTC");
        return;
    };
    static BAD: &str = "extern \"C\" __global__ void k() { undefined_thing(); }";
    let e = nvrtc.compile("bad", BAD, 90, OPTIONS).unwrap_err().to_string();
    assert!(e.contains("undefined_thing"), "{e}");
}

/// The kernels' compile-time A/B switches (`EMBER_KERNEL_DEFINES`), each with every kernel
/// whose source names it, for sm_90: a switch that measurements turn on must compile.
#[test]
fn every_kernel_switch_compiles_for_sm90() {
    const SWITCHES: [&str; 6] =
        ["EMBER_MMA_F32_DECODE", "EMBER_TRACE", "EMBER_AD_PF0", "EMBER_Q6_A2", "EMBER_ROUTE_REGW", "EMBER_ATTN_WGMMA"];
    let Some(nvrtc) = nvrtc() else { return };
    for name in SWITCHES {
        let users: Vec<_> = ALL.iter().filter(|k| k.source().contains(name)).collect();
        assert!(!users.is_empty(), "no kernel source names {name}");
        for kernel in users {
            let src = format!("#define {name} 1\n{}", kernel.source());
            let image = nvrtc.compile_kernel(kernel, &src, 90, OPTIONS).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(matches!(image, Image::Cubin(_)), "{} with {name}: PTX instead of a CUBIN", kernel.name);
            println!("{} with {name}: compiles", kernel.name);
        }
    }
}

/// Prompt attention's wgmma steps together (`EMBER_ATTN_WGMMA` and `EMBER_ATTN_WGMMA_PV`: the
/// second builds on the first), and `attention_wg` with P in shared memory (`EMBER_ATTN_WG_PS`),
/// for sm_90a.
#[test]
fn attention_wgmma_switches_compile_together() {
    let Some(nvrtc) = nvrtc() else { return };
    let cases = [
        (&ember_cuda::kernels::ATTENTION_PREFILL, "#define EMBER_ATTN_WGMMA 1\n#define EMBER_ATTN_WGMMA_PV 1\n", "EMBER_ATTN_WGMMA_PV"),
        (&ember_cuda::kernels::ATTENTION_WG, "#define EMBER_ATTN_WG_PS 1\n", "EMBER_ATTN_WG_PS"),
    ];
    for (kernel, defines, name) in cases {
        assert!(kernel.source().contains(name));
        let src = format!("{defines}{}", kernel.source());
        let image = nvrtc.compile_kernel(kernel, &src, 90, OPTIONS).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(image, Image::Cubin(_)), "PTX instead of a CUBIN");
    }
}

/// Every `attention_decode` entry the launcher names (`ATTENTION_DECODE_ENTRIES`: one per cache
/// type, heads a block and ring, made by the kernel file's macros) is in the compiled image: a
/// name the macros do not make would otherwise show only on a GPU, as a missing function.
#[test]
fn every_attention_decode_entry_the_launcher_names_exists() {
    let Some(nvrtc) = nvrtc() else { return };
    let kernel = &ember_cuda::kernels::ATTENTION_DECODE;
    let Image::Cubin(bytes) = nvrtc.compile(kernel.name, &kernel.source(), 90, OPTIONS).unwrap_or_else(|e| panic!("{e}")) else {
        panic!("PTX instead of a CUBIN")
    };
    for name in ember_cuda::ops::ATTENTION_DECODE_ENTRIES.iter().flatten() {
        // The symbol table holds each entry's name, NUL-terminated.
        let sym = format!("{name}\0");
        assert!(bytes.windows(sym.len()).any(|w| w == sym.as_bytes()), "{name} is not in attention_decode's image");
    }
}
