//! Scale search for ember's weight quantisers (K-quants and IQ4).
//!
//! ember's own method, in the spirit of ggml's `make_qkx2_quants` / `make_qx_quants` but not a
//! port: for a (sub-)block, try a few grids around the plain min/max one, round to each grid,
//! refit scale (and offset) by least squares for those quants, and keep whichever gives the
//! smallest squared error when the block is re-rounded with the refitted scale. Unweighted
//! (no importance matrix). Good enough for synthetic test models; not tuned for perplexity.

/// Number of grid perturbations tried on each side of the min/max grid.
const N_TRY: i32 = 10;
/// Step of the perturbation, in quant levels.
const STEP: f32 = 0.1;

#[inline]
fn round_clamp(v: f32, lo: i32, hi: i32) -> i32 {
    // NaN → 0 via `as`, then clamped: garbage in, garbage (but no panic) out.
    (v.round() as i32).clamp(lo, hi)
}

/// Squared error of `x ≈ a·q − m` with q = nearest level in [0, nmax].
fn err_asym(x: &[f32], a: f32, m: f32, nmax: i32) -> f32 {
    let ia = if a > 0.0 { 1.0 / a } else { 0.0 };
    x.iter()
        .map(|&v| {
            let q = round_clamp((v + m) * ia, 0, nmax) as f32;
            let e = a * q - m - v;
            e * e
        })
        .sum()
}

/// Fits `x ≈ a·q − m` with `q ∈ [0, nmax]`, `a ≥ 0`, `m ≥ 0` (the K-quant sub-block model
/// y = d·sc·q − dmin·mn with unsigned sc, mn). Returns (a, m).
pub(super) fn fit_asym(x: &[f32], nmax: i32) -> (f32, f32) {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // fold(min/max) skips NaN, so hi and lo are numbers (±Inf at worst).
    if hi <= lo {
        // Constant block (or no finite data): all quants 0, offset carries the value.
        return (0.0, -lo.min(0.0));
    }
    let n = x.len() as f64;
    let sx: f64 = x.iter().map(|&v| v as f64).sum();
    let mut best = ((hi - lo) / nmax as f32, -lo);
    let mut best_err = err_asym(x, best.0, best.1, nmax);
    for k in -N_TRY..=N_TRY {
        let iscale = (nmax as f32 + STEP * k as f32) / (hi - lo);
        let (mut sq, mut sqq, mut sqx) = (0f64, 0f64, 0f64);
        for &v in x {
            let q = round_clamp((v - lo) * iscale, 0, nmax) as f64;
            sq += q;
            sqq += q * q;
            sqx += q * v as f64;
        }
        let det = n * sqq - sq * sq;
        if det <= 0.0 {
            continue;
        }
        let mut a = (n * sqx - sq * sx) / det;
        let mut b = (sx - a * sq) / n; // x ≈ a·q + b; the model needs b ≤ 0
        if b > 0.0 {
            b = 0.0;
            a = sqx / sqq;
        }
        if a.is_nan() || a <= 0.0 {
            continue;
        }
        let (a, m) = (a as f32, -b as f32);
        let err = err_asym(x, a, m, nmax);
        if err < best_err {
            best = (a, m);
            best_err = err;
        }
    }
    best
}

/// Squared error of `x ≈ a·q` with q = nearest level in [qmin, qmax].
fn err_sym(x: &[f32], a: f32, qmin: i32, qmax: i32) -> f32 {
    let ia = if a != 0.0 { 1.0 / a } else { 0.0 };
    x.iter()
        .map(|&v| {
            let e = a * round_clamp(v * ia, qmin, qmax) as f32 - v;
            e * e
        })
        .sum()
}

/// The value of largest magnitude, keeping its sign (the first one on ties, as ggml finds it).
pub(super) fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Fits `x ≈ a·q` with `q ∈ [qmin, qmax]` (qmin < 0 < qmax, |qmin| = qmax + 1 as in Q3_K/Q6_K).
/// The scale is signed: the largest-magnitude value maps near `qmin`, which uses the extra
/// negative level. Returns a.
pub(super) fn fit_sym(x: &[f32], qmin: i32, qmax: i32) -> f32 {
    let m = signed_absmax(x);
    if m == 0.0 || !m.is_finite() {
        return 0.0;
    }
    let mut best = m / qmin as f32;
    let mut best_err = err_sym(x, best, qmin, qmax);
    for k in -N_TRY..=N_TRY {
        let target = qmin as f32 + STEP * k as f32;
        if target > -1.0 {
            continue;
        }
        let iscale = target / m;
        let (mut sqq, mut sqx) = (0f64, 0f64);
        for &v in x {
            let q = round_clamp(v * iscale, qmin, qmax) as f64;
            sqq += q * q;
            sqx += q * v as f64;
        }
        if sqq == 0.0 {
            continue;
        }
        let a = (sqx / sqq) as f32;
        let err = err_sym(x, a, qmin, qmax);
        if err < best_err {
            best = a;
            best_err = err;
        }
    }
    best
}

/// Index of the table entry nearest to `v` (`table` ascending).
#[inline]
pub(super) fn nearest_index(table: &[i8; 16], v: f32) -> usize {
    let mut best = 0;
    let mut best_d = f32::INFINITY;
    for (i, &k) in table.iter().enumerate() {
        let d = (k as f32 - v).abs();
        if d < best_d {
            best_d = d;
            best = i;
        }
    }
    best
}

fn err_table(x: &[f32], a: f32, table: &[i8; 16]) -> f32 {
    let ia = if a != 0.0 { 1.0 / a } else { 0.0 };
    x.iter()
        .map(|&v| {
            let e = a * table[nearest_index(table, v * ia)] as f32 - v;
            e * e
        })
        .sum()
}

/// Fits `x ≈ a·table[i]` (IQ4 non-linear levels). The largest-magnitude value maps near
/// `table[0]` (the most extreme level). Returns a.
pub(super) fn fit_table(x: &[f32], table: &[i8; 16]) -> f32 {
    let m = signed_absmax(x);
    if m == 0.0 || !m.is_finite() {
        return 0.0;
    }
    let t0 = table[0] as f32;
    let mut best = m / t0;
    let mut best_err = err_table(x, best, table);
    // Coarser steps than fit_sym: the table spans ±127, so one level is ~10-20 units.
    for k in -N_TRY..=N_TRY {
        let iscale = (t0 + k as f32) / m;
        let (mut skk, mut skx) = (0f64, 0f64);
        for &v in x {
            let kv = table[nearest_index(table, v * iscale)] as f64;
            skk += kv * kv;
            skx += kv * v as f64;
        }
        if skk == 0.0 {
            continue;
        }
        let a = (skx / skk) as f32;
        let err = err_table(x, a, table);
        if err < best_err {
            best = a;
            best_err = err;
        }
    }
    best
}
