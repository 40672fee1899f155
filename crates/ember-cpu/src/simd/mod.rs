//! SIMD kernels behind one small trait ([`Kernels`]), with the instruction set chosen once at
//! run time ([`Isa::detect`]).
//!
//! Every kernel has the same meaning as its scalar reference: the quantised dots equal
//! [`crate::kernels::dot`] (same integer sums, f32 scaling in another order), the activation
//! quantiser is bit-identical to [`ActRow::quantize`], the float dots sum f32 products. Tests at
//! the bottom check each instruction set the CPU has against the reference on random data with
//! odd sizes.
//!
//! Kernels take `NT` activation rows at once (`NT` = 1 for decode, 4 for prompt tiles) so a
//! weight block is loaded and unpacked once and used for `NT` tokens.
//!
//! The decision a reader may question: the x86 kernels are written once (a macro in
//! [`avx2`]) and instantiated twice, with the AVX2 `maddubs` product and with the AVX-512 VNNI
//! `dpbusd` product, both on 256-bit vectors: 32 weights is the block size of every format, a
//! 256-bit vector holds one block, and decode is bound by memory, not by vector width.

use ember_gguf::GgmlType;
use ember_ops::{KV_PAGE, KvPage};

use crate::kernels::{self, ActRow};
use crate::panel::{self, Panel};

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "aarch64")]
pub mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_int;

/// An instruction set with kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL + VNNI (plus everything of AVX2).
    Avx512,
    /// aarch64 NEON (float kernels; quantised dots use the scalar path for now).
    Neon,
}

impl Isa {
    /// The best instruction set this CPU has; `EMBER_ISA=scalar|avx2|avx512` caps it (for
    /// measurements and tests). Detected once.
    pub fn detect() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Isa::available().into_iter().max().unwrap_or(Isa::Scalar);
            match std::env::var("EMBER_ISA").ok().as_deref() {
                Some("scalar") => Isa::Scalar,
                Some("avx2") if best >= Isa::Avx2 => Isa::Avx2,
                _ => best,
            }
        })
    }

    /// Every instruction set this CPU can run, scalar first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if avx2::Avx2::new().is_some() {
                v.push(Isa::Avx2);
            }
            if avx512::Avx512::new().is_some() {
                v.push(Isa::Avx512);
            }
        }
        #[cfg(target_arch = "aarch64")]
        if neon::Neon::new().is_some() {
            v.push(Isa::Neon);
        }
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512-vnni",
            Isa::Neon => "neon",
        }
    }
}

/// Calls `$body` with `$k` bound to the kernel token of `$isa` (a zero-sized type), so the
/// generic code behind it is compiled once per instruction set and dispatched once per op.
#[macro_export]
#[doc(hidden)]
macro_rules! with_kernels {
    ($isa:expr, |$k:ident| $body:expr) => {{
        match $isa {
            #[cfg(target_arch = "x86_64")]
            $crate::simd::Isa::Avx512 => {
                // unwrap: Isa::Avx512 is produced only by detection that found the features.
                let $k = $crate::simd::avx512::Avx512::new().unwrap();
                $body
            }
            #[cfg(target_arch = "x86_64")]
            $crate::simd::Isa::Avx2 => {
                // unwrap: as above.
                let $k = $crate::simd::avx2::Avx2::new().unwrap();
                $body
            }
            #[cfg(target_arch = "aarch64")]
            $crate::simd::Isa::Neon => {
                // unwrap: as above.
                let $k = $crate::simd::neon::Neon::new().unwrap();
                $body
            }
            _ => {
                let $k = $crate::simd::Scalar;
                $body
            }
        }
    }};
}
pub use with_kernels;

/// The kernels one instruction set provides. Implemented by zero-sized tokens that can only be
/// made when the CPU has the instruction set.
pub trait Kernels: Copy + Send + Sync + 'static {
    /// `out[t] = Σ_j W[j]·a[t][j]` for one weight row of quantised type `ty`
    /// ([`kernels::supported`]) and `NT` activation rows of the same length.
    fn dot_q<const NT: usize>(self, ty: GgmlType, w: &[u8], a: [&ActRow; NT]) -> [f32; NT];

    /// Single-token dots of consecutive rows: `out[j]` = row j of `rows` (`rb` bytes each) ·
    /// `a`, for every `j < out.len()`, with `pf(j)` called just before row j (the caller's
    /// prefetches). Same results as [`Kernels::dot_q`] row by row, which the default does; the
    /// x86 kernels dispatch on the type once per call instead of once per row.
    fn dot_rows(self, ty: GgmlType, rows: &[u8], rb: usize, a: &ActRow, out: &mut [f32], mut pf: impl FnMut(usize)) {
        for (j, (row, o)) in rows.chunks_exact(rb).zip(out.iter_mut()).enumerate() {
            pf(j);
            *o = self.dot_q::<1>(ty, row, [a])[0];
        }
    }

    /// `out[t] = Σ_j W[j]·x[t][j]` for one weight row of type F32, F16 or BF16, in f32.
    fn dot_float<const NT: usize>(self, ty: GgmlType, w: &[u8], x: [&[f32]; NT]) -> [f32; NT];

    /// [`ActRow::quantize`], bit for bit.
    fn quantize(self, x: &[f32], out: &mut ActRow);

    /// [`ActRow::quantize_grouped`], bit for bit.
    fn quantize_grouped(self, x: &[f32], out: &mut ActRow) {
        ActRow::quantize_grouped(x, out)
    }

    /// Whether the single-token K-quant kernels are faster on grouped activation rows
    /// ([`ActRow::quantize_grouped`]; they take either).
    fn wants_grouped(self) -> bool {
        false
    }

    /// Σ a·b in f32.
    fn dot_f32(self, a: &[f32], b: &[f32]) -> f32;

    /// `y += a·x`.
    fn axpy(self, a: f32, x: &[f32], y: &mut [f32]);

    /// `y[i] += a[i]·x[i]`.
    fn mul_add(self, a: &[f32], x: &[f32], y: &mut [f32]);

    /// `x[i] = exp(x[i] − sub)`; returns Σ x[i] (f32). Max relative error of exp ~2 ulp.
    fn exp_sum(self, x: &mut [f32], sub: f32) -> f32;

    /// `x ← x·sigmoid(x)` (SiLU) in place.
    fn silu(self, x: &mut [f32]);

    /// f16 values (little-endian bytes) to f32.
    fn f16_to_f32(self, src: &[u8], dst: &mut [f32]);

    /// Q8_0 blocks (34 bytes: an f16 scale d, 32 int8 q) to f32 `d·q`, as
    /// `ember_gguf::quant::dequantize` computes them: whole blocks of `src` into `dst`, as many
    /// as both hold. The default is the scalar loop.
    fn q8_0_to_f32(self, src: &[u8], dst: &mut [f32]) {
        q8_0_to_f32_scalar(src, dst)
    }

    /// One token of the gated delta rule for one value head (qwen35moe.md §6.4 step 8), with
    /// the state stored transposed (`st[jv·d_k + i] = S[i][jv]`, a row per value index):
    /// `S ← decay·S;  δ = β(v − Sᵀk);  S ← S + kδᵀ;  o = Sᵀq`.
    #[allow(clippy::too_many_arguments)]
    fn delta_step(self, st: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: f32, beta: f32, o: &mut [f32]);

    /// The delta rule over the `io.n` tokens of one head: [`Kernels::delta_step`] for each
    /// token in turn (state layout as there). The default does exactly that.
    fn delta_seq(self, st: &mut [f32], io: &DeltaIo<'_>, o: &mut [f32]) {
        delta_stepwise(self, st, io, o)
    }

    /// Attention of the query heads in `io` over their shared KV head (f16 caches):
    /// `out[n] = softmax(scale·q_n·Kᵀ)·V`. `scores` is scratch of at least heads·npos values;
    /// `ml[2n]`, `ml[2n + 1]` get head n's largest score and Σ exp(score − largest), so results
    /// over separate position ranges can be merged (flash-decoding). Returns false when this
    /// instruction set has no such kernel (the caller then runs the generic loop); the default
    /// has none.
    fn attn_f16(self, io: &AttnIo<'_>, scores: &mut [f32], out: &mut [f32], ml: &mut [f32]) -> bool {
        let _ = (io, scores, out, ml);
        false
    }

    /// [`Kernels::attn_f16`] over q8_0 caches (`io.off` a whole number of blocks). Where the
    /// kernel runs P·V in bf16 (`has_bf16`), the probabilities times each value block's d are
    /// rounded to bf16 (the int8 values are exact). The default has none.
    fn attn_q8(self, io: &AttnIo<'_>, scores: &mut [f32], out: &mut [f32], ml: &mut [f32]) -> bool {
        let _ = (io, scores, out, ml);
        false
    }

    /// `C ← A·B`, or `C ← C + A·B` when `g.acc`, for the f32 matrices of `g` (see [`Gemm`]):
    /// the tiled prompt attention's two products, scores = Q·Kᵀ and O += P·V, and decode's
    /// O += P·V over chunks of converted value rows. Each product is
    /// summed along `kd` in order (the SIMD forms with FMA). The default is the scalar loop.
    fn gemm_f32(self, g: &Gemm<'_>, c: &mut [f32]) {
        g.check(c);
        gemm_f32_scalar(g, c)
    }

    /// `C ← C + A·B` for the bf16 matrices of `g` (see [`GemmBf16`]), each pair of products
    /// summed in f32: the tiled prompt attention's O += P·V where [`Kernels::has_bf16`]. The
    /// default is the scalar loop.
    fn gemm_bf16(self, g: &GemmBf16<'_>, c: &mut [f32]) {
        g.check(c);
        gemm_bf16_scalar(g, c)
    }

    /// Whether [`Kernels::gemm_bf16`] is a fast kernel on this CPU (AVX-512 BF16 whose
    /// `vdpbf16ps` outruns f32 FMAs, timed once), worth converting a prompt's values and
    /// probabilities to bf16 for. `EMBER_BF16=0` or `1` decides instead (for measurements).
    fn has_bf16(self) -> bool {
        false
    }

    /// `dst[i]` = `src[i]` rounded to bf16 (to nearest, ties to even). The default is
    /// [`bf16_of`] per value.
    fn f32_to_bf16(self, src: &[f32], dst: &mut [u16]) {
        assert!(dst.len() >= src.len(), "f32_to_bf16: {} values into {}", src.len(), dst.len());
        dst.iter_mut().zip(src).for_each(|(d, x)| *d = bf16_of(*x));
    }

    /// Whether this instruction set has fast [`Panel`] kernels (worth using for prompts).
    fn has_panels(self) -> bool {
        false
    }

    /// Whether the single-token Q4_K kernel reads [`ActRow::qk`] (filled by
    /// [`ActRow::fill_k4_order`]) rather than `q`.
    fn wants_k4_order(self) -> bool {
        false
    }

    /// Unpacks `m` (1..=16) consecutive rows of `ty` ([`panel::supported`]), `k` weights each,
    /// stored back to back in `rows`, into `p`. The default is the scalar unpacker.
    fn panel_unpack(self, ty: GgmlType, k: usize, rows: &[u8], m: usize, p: &mut Panel) {
        let rb = ty.row_bytes(k).expect("panel rows are whole blocks");
        let rs: Vec<&[u8]> = (0..m).map(|r| &rows[r * rb..(r + 1) * rb]).collect();
        p.unpack_scalar(ty, k, &rs);
    }

    /// `out[t]` = the panel's 16 row dots with activation row `a[t]` (whose
    /// [`ActRow::qu`] is filled). The default is the scalar product.
    fn panel_dot(self, p: &Panel, a: &[&ActRow], out: &mut [[f32; panel::ROWS]]) {
        for (o, a) in out.iter_mut().zip(a) {
            *o = p.dot_scalar(a);
        }
    }
}

/// The inputs of [`Kernels::delta_seq`] for one head: token t's query and key are
/// `q[t·sqk..][..dk]`, `k[t·sqk..][..dk]`, its value `v[t·sv..][..dv]`.
#[derive(Debug, Clone, Copy)]
pub struct DeltaIo<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub sqk: usize,
    pub sv: usize,
    pub decay: &'a [f32],
    pub beta: &'a [f32],
    pub n: usize,
    pub dk: usize,
    pub dv: usize,
}

impl<'a> DeltaIo<'a> {
    /// Tokens `t0..t0 + n` alone.
    pub fn tokens(&self, t0: usize, n: usize) -> DeltaIo<'a> {
        assert!(t0 + n <= self.n, "DeltaIo::tokens: {t0}+{n} of {}", self.n);
        let (a, b) = (t0 * self.sqk, t0 * self.sv);
        DeltaIo { q: &self.q[a..], k: &self.k[a..], v: &self.v[b..], decay: &self.decay[t0..], beta: &self.beta[t0..], n, ..*self }
    }

    /// Token t's (q, k, v).
    #[inline]
    pub fn token(&self, t: usize) -> (&'a [f32], &'a [f32], &'a [f32]) {
        let (a, b) = (t * self.sqk, t * self.sv);
        (&self.q[a..a + self.dk], &self.k[a..a + self.dk], &self.v[b..b + self.dv])
    }
}

/// A small f32 matrix product for [`Kernels::gemm_f32`]: A is `m×kd` (row i at `a[i·lda..]`),
/// B is `kd×n` (row k at `b[k·ldb..]`), C is `m×n` (row i at `c[i·ldc..]`).
#[derive(Debug, Clone, Copy)]
pub struct Gemm<'a> {
    pub a: &'a [f32],
    pub lda: usize,
    pub b: &'a [f32],
    pub ldb: usize,
    pub ldc: usize,
    pub m: usize,
    pub n: usize,
    pub kd: usize,
    /// Add to C instead of overwriting it.
    pub acc: bool,
}

impl Gemm<'_> {
    /// Panics unless every element the product reads or writes lies inside `a`, `b` and `c`
    /// (the SIMD forms index through pointers after this check).
    pub fn check(&self, c: &[f32]) {
        let Gemm { a, lda, b, ldb, ldc, m, n, kd, .. } = *self;
        let fits =
            |len: usize, rows: usize, ld: usize, cols: usize| rows == 0 || cols == 0 || (ld >= cols && len >= (rows - 1) * ld + cols);
        assert!(
            fits(a.len(), m, lda, kd) && fits(b.len(), kd, ldb, n) && fits(c.len(), m, ldc, n),
            "gemm_f32: {m}x{kd} · {kd}x{n} does not fit its buffers ({} / {} / {})",
            a.len(),
            b.len(),
            c.len()
        );
    }
}

/// A product for [`Kernels::gemm_bf16`] in bf16 (`u16` bit patterns), summed along `kd` in
/// pairs: A is `m×2kp` (row i at `a[i·lda..]`); B is `2kp×n` stored as `kp` pair rows, pair
/// row t at `b[t·ldb..]` holding `(B[2t][j], B[2t+1][j])` at `2j, 2j + 1` (the operand layout
/// of `vdpbf16ps`); C is `m×n` f32 (row i at `c[i·ldc..]`), added to.
#[derive(Debug, Clone, Copy)]
pub struct GemmBf16<'a> {
    pub a: &'a [u16],
    pub lda: usize,
    pub b: &'a [u16],
    pub ldb: usize,
    pub ldc: usize,
    pub m: usize,
    pub n: usize,
    /// Pairs along kd.
    pub kp: usize,
}

impl GemmBf16<'_> {
    /// Panics unless every element the product reads or writes lies inside `a`, `b` and `c`
    /// (the SIMD form indexes through pointers after this check).
    pub fn check(&self, c: &[f32]) {
        let GemmBf16 { a, lda, b, ldb, ldc, m, n, kp } = *self;
        let fits =
            |len: usize, rows: usize, ld: usize, cols: usize| rows == 0 || cols == 0 || (ld >= cols && len >= (rows - 1) * ld + cols);
        assert!(
            fits(a.len(), m, lda, 2 * kp) && fits(b.len(), kp, ldb, 2 * n) && fits(c.len(), m, ldc, n),
            "gemm_bf16: {m}x{} · {}x{n} does not fit its buffers ({} / {} / {})",
            2 * kp,
            2 * kp,
            a.len(),
            b.len(),
            c.len()
        );
    }
}

/// `x` rounded to the nearest bf16 (ties to even; a NaN stays a NaN).
#[inline]
pub fn bf16_of(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7fc0;
    }
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The f32 value of bf16 bits `h`.
#[inline]
pub fn f32_of_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// [`Kernels::gemm_bf16`] in plain f32 (the scalar kernel, and the reference of the tests):
/// each pair's two products added, then the pair's sum added to C.
pub fn gemm_bf16_scalar(g: &GemmBf16<'_>, c: &mut [f32]) {
    for i in 0..g.m {
        for t in 0..g.kp {
            let (a0, a1) = (f32_of_bf16(g.a[i * g.lda + 2 * t]), f32_of_bf16(g.a[i * g.lda + 2 * t + 1]));
            let br = &g.b[t * g.ldb..t * g.ldb + 2 * g.n];
            let cr = &mut c[i * g.ldc..i * g.ldc + g.n];
            for (x, b) in cr.iter_mut().zip(br.chunks_exact(2)) {
                *x += a0 * f32_of_bf16(b[0]) + a1 * f32_of_bf16(b[1]);
            }
        }
    }
}

/// [`Kernels::gemm_f32`] in plain f32 (the scalar kernel, and the reference of the tests).
pub fn gemm_f32_scalar(g: &Gemm<'_>, c: &mut [f32]) {
    for i in 0..g.m {
        let cr = &mut c[i * g.ldc..i * g.ldc + g.n];
        if !g.acc {
            cr.fill(0.0);
        }
        for k in 0..g.kd {
            let a = g.a[i * g.lda + k];
            cr.iter_mut().zip(&g.b[k * g.ldb..k * g.ldb + g.n]).for_each(|(c, b)| *c += a * b);
        }
    }
}

/// The inputs of [`Kernels::attn_f16`] and [`Kernels::attn_q8`]: the `q.len() / hd` query
/// heads `q` (`[head][hd]`) of `n_kv` KV heads (an equal run of query heads each), and
/// positions 0..npos of the caches `k`, `v` (page tables of [`KV_PAGE`] rows of `rb` bytes),
/// where position p's values for the first KV head start at value `off` of row `p % KV_PAGE`
/// of page `p / KV_PAGE` (byte `2·off` of the row in f16, `off / 32 · 34` in q8_0), the next
/// KV head's `hd` values later.
#[derive(Debug, Clone, Copy)]
pub struct AttnIo<'a> {
    pub q: &'a [f32],
    pub k: &'a [KvPage],
    pub v: &'a [KvPage],
    pub rb: usize,
    pub off: usize,
    pub npos: usize,
    pub hd: usize,
    pub scale: f32,
    pub n_kv: usize,
}

impl AttnIo<'_> {
    /// KV head m's part: its query heads, its values' offset, one KV head.
    pub fn kv_head(&self, m: usize) -> AttnIo<'_> {
        let g = self.q.len() / self.hd / self.n_kv;
        AttnIo { q: &self.q[m * g * self.hd..(m + 1) * g * self.hd], off: self.off + m * self.hd, n_kv: 1, ..*self }
    }

    /// The `hd` f16 values of position `p` for the (first) KV head in the K cache.
    #[inline]
    pub fn k_row(&self, p: usize) -> &[u8] {
        let at = (p % KV_PAGE) * self.rb + 2 * self.off;
        &self.k[p / KV_PAGE][at..at + 2 * self.hd]
    }

    /// As [`AttnIo::k_row`], in the V cache.
    #[inline]
    pub fn v_row(&self, p: usize) -> &[u8] {
        let at = (p % KV_PAGE) * self.rb + 2 * self.off;
        &self.v[p / KV_PAGE][at..at + 2 * self.hd]
    }

    /// The `hd / 32` q8_0 blocks (34 bytes each) of position `p` for this KV head in the K
    /// cache.
    #[inline]
    pub fn k_q8(&self, p: usize) -> &[u8] {
        let at = (p % KV_PAGE) * self.rb + self.off / 32 * 34;
        &self.k[p / KV_PAGE][at..at + self.hd / 32 * 34]
    }

    /// As [`AttnIo::k_q8`], in the V cache.
    #[inline]
    pub fn v_q8(&self, p: usize) -> &[u8] {
        let at = (p % KV_PAGE) * self.rb + self.off / 32 * 34;
        &self.v[p / KV_PAGE][at..at + self.hd / 32 * 34]
    }
}

/// The checks shared by the [`Kernels::attn_f16`] kernels (and with `q8` the
/// [`Kernels::attn_q8`] ones): every slice they read lies inside `io`'s caches and the
/// buffers. False when the shape has no kernel (head size not a multiple of 32, `off` not of
/// whole q8_0 blocks, query heads not an equal run per KV head) or nothing to do.
pub(crate) fn attn_check(io: &AttnIo<'_>, q8: bool, scores: &[f32], out: &[f32], ml: &[f32]) -> bool {
    let AttnIo { q, k, v, rb, off, npos, hd, n_kv, .. } = *io;
    let heads = q.len() / hd.max(1);
    if hd == 0 || !hd.is_multiple_of(32) || (q8 && !off.is_multiple_of(32)) || heads == 0 || npos == 0 || n_kv == 0 {
        return false;
    }
    if !heads.is_multiple_of(n_kv) {
        return false;
    }
    assert!(q.len() == heads * hd && out.len() >= heads * hd && scores.len() >= heads * npos && ml.len() >= 2 * heads);
    // Every position's head slices lie inside both caches (the row accessors also check).
    let n_pages = npos.div_ceil(KV_PAGE);
    let whole = |pages: &[KvPage]| pages.len() >= n_pages && pages[..n_pages].iter().all(|pg| pg.len() >= KV_PAGE * rb);
    let last = off + n_kv * hd;
    let end = if q8 { last / 32 * 34 } else { 2 * last };
    assert!(whole(k) && whole(v) && end <= rb, "attention kernel: cache rows out of bounds");
    true
}

/// [`attn_check`], then `group(nh, io, scores, out, ml)` for each run of at most 8 query heads
/// of one KV head (`io` that KV head's, `io.q`, `scores`, `out` and `ml` narrowed to the run),
/// KV head by KV head. False, calling nothing, where [`attn_check`] is.
pub(crate) fn attn_groups(
    io: &AttnIo<'_>,
    q8: bool,
    scores: &mut [f32],
    out: &mut [f32],
    ml: &mut [f32],
    mut group: impl FnMut(usize, &AttnIo<'_>, &mut [f32], &mut [f32], &mut [f32]),
) -> bool {
    if !attn_check(io, q8, scores, out, ml) {
        return false;
    }
    let (hd, npos) = (io.hd, io.npos);
    let g = io.q.len() / hd / io.n_kv;
    for m in 0..io.n_kv {
        let km = io.kv_head(m);
        let mut h = 0;
        while h < g {
            let nh = (g - h).min(8);
            let h0 = m * g + h;
            let (qg, og) = (&km.q[h * hd..(h + nh) * hd], &mut out[h0 * hd..(h0 + nh) * hd]);
            group(nh, &AttnIo { q: qg, ..km }, &mut scores[h0 * npos..(h0 + nh) * npos], og, &mut ml[2 * h0..2 * (h0 + nh)]);
            h += nh;
        }
    }
    true
}

/// The checks shared by the column-block [`Kernels::delta_seq`] kernels (`cols` value columns
/// per block), and the per-token `k·q` they use; None when the shape takes the stepwise form.
pub(crate) fn delta_columns_kq(st: &[f32], io: &DeltaIo<'_>, o: &[f32], cols: usize) -> Option<Vec<f32>> {
    if io.n < 2 || !io.dv.is_multiple_of(cols) || !io.dk.is_multiple_of(4) {
        return None;
    }
    assert!(st.len() >= io.dk * io.dv && o.len() >= io.n * io.dv && io.decay.len() >= io.n && io.beta.len() >= io.n);
    // Bounds of the last token's reads (the kernels read tokens 0..n through `token`).
    let _ = io.token(io.n - 1);
    Some(
        (0..io.n)
            .map(|t| {
                let (q, k, _) = io.token(t);
                q.iter().zip(k).map(|(a, b)| a * b).sum()
            })
            .collect(),
    )
}

/// Tokens per pass of the column-block delta rule (`EMBER_DELTA_CHUNK` overrides; read once).
/// The kernels sweep the tokens once per block of value columns; over a whole prompt one
/// head's q and k rows (1 KiB a token, 8 KiB apart) fall out of L2 between sweeps and every
/// token's rows came from L3 again, page by page, 16 times. In chunks of this many tokens they
/// stay in L2 for all the blocks; the state goes back to `st` between chunks, and each chunk
/// starts from it as the first did (same operations in the same order: bit for bit).
fn delta_chunk() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("EMBER_DELTA_CHUNK").ok().and_then(|s| s.parse().ok()).filter(|&n| n > 0).unwrap_or(DELTA_CHUNK))
}

const DELTA_CHUNK: usize = 64;

/// Runs `block(io', kq', o', c)` for every chunk of tokens ([`delta_chunk`]) and every block
/// `c < io.dv / cols` of value columns, chunk by chunk: `io'`, `kq'` and `o'` are the chunk's.
pub(crate) fn delta_columns_chunked(
    io: &DeltaIo<'_>,
    kq: &[f32],
    o: &mut [f32],
    cols: usize,
    mut block: impl FnMut(&DeltaIo<'_>, &[f32], &mut [f32], usize),
) {
    let step = delta_chunk();
    let mut t0 = 0;
    while t0 < io.n {
        let n = step.min(io.n - t0);
        let sub = io.tokens(t0, n);
        for c in 0..io.dv / cols {
            block(&sub, &kq[t0..t0 + n], &mut o[t0 * io.dv..(t0 + n) * io.dv], c);
        }
        t0 += n;
    }
}

/// [`Kernels::delta_step`] for each of the `io.n` tokens in turn (the default
/// [`Kernels::delta_seq`], and the batch-invariant path).
pub fn delta_stepwise<K: Kernels>(k: K, st: &mut [f32], io: &DeltaIo<'_>, o: &mut [f32]) {
    for t in 0..io.n {
        let (qt, kt, vt) = io.token(t);
        k.delta_step(st, qt, kt, vt, io.decay[t], io.beta[t], &mut o[t * io.dv..(t + 1) * io.dv]);
    }
}

/// [`Kernels::delta_step`] in plain f32 (the scalar kernel, and the reference of the tests).
#[allow(clippy::too_many_arguments)]
pub fn delta_step_scalar(st: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: f32, beta: f32, o: &mut [f32]) {
    let dk = k.len();
    for (jv, row) in st.chunks_exact_mut(dk).enumerate() {
        let r = decay * dot_f32_scalar(row, k);
        let delta = beta * (v[jv] - r);
        row.iter_mut().zip(k).for_each(|(x, kk)| *x = *x * decay + kk * delta);
        o[jv] = dot_f32_scalar(row, q);
    }
}

/// The scalar kernels (the reference, and the fallback everywhere).
#[derive(Debug, Clone, Copy)]
pub struct Scalar;

impl Kernels for Scalar {
    fn dot_q<const NT: usize>(self, ty: GgmlType, w: &[u8], a: [&ActRow; NT]) -> [f32; NT] {
        a.map(|a| kernels::dot(ty, w, a))
    }

    fn dot_float<const NT: usize>(self, ty: GgmlType, w: &[u8], x: [&[f32]; NT]) -> [f32; NT] {
        x.map(|x| dot_float_scalar(ty, w, x))
    }

    fn quantize(self, x: &[f32], out: &mut ActRow) {
        ActRow::quantize(x, out)
    }

    fn dot_f32(self, a: &[f32], b: &[f32]) -> f32 {
        dot_f32_scalar(a, b)
    }

    fn axpy(self, a: f32, x: &[f32], y: &mut [f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
    }

    fn mul_add(self, a: &[f32], x: &[f32], y: &mut [f32]) {
        y.iter_mut().zip(a).zip(x).for_each(|((y, a), x)| *y += a * x);
    }

    fn exp_sum(self, x: &mut [f32], sub: f32) -> f32 {
        x.iter_mut()
            .map(|v| {
                *v = (*v - sub).exp();
                *v
            })
            .sum()
    }

    fn silu(self, x: &mut [f32]) {
        x.iter_mut().for_each(|v| *v = ember_ops::reference::silu(*v));
    }

    fn f16_to_f32(self, src: &[u8], dst: &mut [f32]) {
        for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
            *d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        }
    }

    fn delta_step(self, st: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: f32, beta: f32, o: &mut [f32]) {
        delta_step_scalar(st, q, k, v, decay, beta, o)
    }
}

/// The scalar [`Kernels::q8_0_to_f32`].
pub fn q8_0_to_f32_scalar(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        o.iter_mut().zip(&b[2..]).for_each(|(o, &q)| *o = d * q as i8 as f32);
    }
}

/// Asks the CPU to start loading `b` into L2 (a hint: no effect on results). Used a few weight
/// rows ahead of the GEMV, whose loads would otherwise wait on DRAM latency in turn.
#[inline]
pub fn prefetch(b: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in b.chunks(64) {
        // SAFETY: prefetch is a hint that never faults; the address is inside `b` anyway.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = b;
}

/// Prefetch distance in bytes (`EMBER_PF_BYTES` overrides; read once).
pub static PF_BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Weight `i` of a float row.
#[inline]
pub fn float_at(ty: GgmlType, w: &[u8], i: usize) -> f32 {
    match ty {
        GgmlType::F32 => f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]),
        GgmlType::F16 => half::f16::from_le_bytes([w[2 * i], w[2 * i + 1]]).to_f32(),
        _ => f32::from_bits((u16::from_le_bytes([w[2 * i], w[2 * i + 1]]) as u32) << 16), // BF16
    }
}

/// Float weight row · f32 activations, 8 partial sums.
pub fn dot_float_scalar(ty: GgmlType, w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = x.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        for l in 0..8 {
            acc[l] += float_at(ty, w, i + l) * x[i + l];
        }
    }
    let tail: f32 = (n8..x.len()).map(|i| float_at(ty, w, i) * x[i]).sum();
    acc.iter().sum::<f32>() + tail
}

/// f32 dot product with 8 independent partial sums.
pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests;
