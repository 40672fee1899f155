//! Values of one chunk of rows of a planned tensor, and their encoding.

use ember_gguf::{GgmlType, quant};

use crate::Error;
use crate::fastq;
use crate::plan::{Init, Plan, Planned, scale};
use crate::rng::{Rng, mix};

/// Weights per chunk (rounded to whole rows): big enough to amortise the task overhead, small
/// enough that a batch of them for every thread stays within a few hundred MiB.
pub const CHUNK_WEIGHTS: usize = 1 << 20;

/// Rows per chunk of tensor `t`. Routers and 1-D tensors are one chunk (the router's rows are
/// drawn together so they can be orthogonalised against the shared direction).
pub fn rows_per_chunk(t: &Planned) -> usize {
    match t.init {
        Init::Router { .. } => t.n_rows(),
        _ => (CHUNK_WEIGHTS / t.row_len()).clamp(1, t.n_rows()),
    }
}

/// Encoded bytes of rows `row0 .. row0 + n` of tensor `idx`.
pub fn chunk_bytes(plan: &Plan, idx: usize, row0: usize, n: usize) -> Result<Vec<u8>, Error> {
    let t = &plan.tensors[idx];
    let k = t.row_len();
    let mut x = vec![0f32; n * k];
    let chunk = (row0 / rows_per_chunk(t)) as u64;
    let mut rng = Rng::new(mix(&[plan.opts.seed, idx as u64, chunk]));
    fill(plan, t, row0, &mut rng, &mut x);
    let ty = t.spec.ggml_type;
    // unwrap-free: the plan only holds row lengths that fit the type (recipe fallback).
    let row_bytes = ty.row_bytes(k).ok_or_else(|| Error::BadShape(format!("{}: row of {k} does not fit {ty}", t.spec.name)))?;
    let mut out = vec![0u8; n * row_bytes];
    match ty {
        GgmlType::Q4K => fastq::quant_q4k(&x, &mut out),
        GgmlType::Q6K => fastq::quant_q6k(&x, &mut out),
        _ => quant::quantize(ty, &x, &mut out).map_err(Error::Gguf)?,
    }
    Ok(out)
}

/// Draws the f32 values of rows `row0 ..` of `t` into `x` (a whole number of rows).
fn fill(plan: &Plan, t: &Planned, row0: usize, rng: &mut Rng, x: &mut [f32]) {
    let k = t.row_len();
    match t.init {
        Init::Const(c) => x.fill(c),
        Init::Normal(std) => rng.fill_normal(x, std),
        Init::Embedding => {
            for row in x.chunks_exact_mut(k) {
                for (v, s) in row.iter_mut().zip(&plan.shared_sign) {
                    *v = rng.normal() + scale::EMBD_SHARED * s;
                }
            }
        }
        Init::SsmA => x.iter_mut().for_each(|v| *v = -(1.0 + 15.0 * rng.uniform())),
        Init::SsmDt => x.iter_mut().for_each(|v| {
            let dt = (1e-3f32.ln() + (0.1f32.ln() - 1e-3f32.ln()) * rng.uniform()).exp();
            *v = dt + (-(-dt).exp_m1()).ln(); // softplus⁻¹(dt)
        }),
        Init::Router { layer } => router(plan, layer, row0, rng, x),
    }
}

/// Router rows (one per expert): ℓ_e = w_e·f should be noise of std ROUTER_NOISE plus the
/// popularity β_e = −skew·ln(rank_e). With ρ the predicted share of the normed input f along
/// û (|f| ≈ √D): w_e = σ·(noise ⊥ û) + β_e/(ρ√D)·û, σ = ROUTER_NOISE/(√D·√(1−ρ²)).
fn router(plan: &Plan, layer: usize, row0: usize, rng: &mut Rng, x: &mut [f32]) {
    let d = plan.opts.shape.n_embd;
    let n_e = x.len() / d;
    let rho = plan.shared_fraction(layer);
    let sqrt_d = (d as f32).sqrt();
    let sigma = scale::ROUTER_NOISE / (sqrt_d * (1.0 - rho * rho).sqrt());
    let u: Vec<f32> = plan.shared_sign.iter().map(|s| s / sqrt_d).collect();
    // Popularity order differs per layer; drawn from its own stream so the noise is the same
    // for every skew (skew changes nothing but the component along û).
    let rank = Rng::new(mix(&[plan.opts.seed, 0x52414E4B, layer as u64])).permutation(n_e); // "RANK"
    for (e, row) in x.chunks_exact_mut(d).enumerate() {
        rng.fill_normal(row, sigma);
        let along: f32 = row.iter().zip(&u).map(|(a, b)| a * b).sum();
        let beta = -plan.opts.skew * ((rank[row0 + e] + 1) as f32).ln();
        let coef = beta / (rho * sqrt_d) - along;
        row.iter_mut().zip(&u).for_each(|(a, b)| *a += coef * b);
    }
}

/// The popularity rank (0 = most popular) of each expert of trunk block `layer`.
pub fn expert_rank(plan: &Plan, layer: usize) -> Vec<usize> {
    Rng::new(mix(&[plan.opts.seed, 0x52414E4B, layer as u64])).permutation(plan.opts.shape.n_expert)
}
