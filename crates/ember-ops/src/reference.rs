//! Scalar reference ops: straightforward, single-threaded, f32 storage with f64 sums where a
//! reduction is long. This is the spec in code; fast backends are tested against it.

use crate::{AttnMats, AttnPrep, AttnShape, DeltaMats, DeltaPrep, DeltaShape, ExpertId, KvRows, Mat, MoeSlot, RouteTable, WeightView};

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `y ← y ⊙ act(g)` ([`crate::Ops::gate`]).
pub fn gate(y: &mut Mat, g: &Mat, act: crate::Gate) {
    assert_eq!((y.n, y.d), (g.n, g.d), "gate: {}x{} gated by {}x{}", y.n, y.d, g.n, g.d);
    let f = match act {
        crate::Gate::Silu => silu,
        crate::Gate::Sigmoid => sigmoid,
    };
    y.data.iter_mut().zip(&g.data).for_each(|(v, g)| *v *= f(*g));
}

/// softplus with PyTorch's/ggml's threshold 20 (qwen35moe.md §5).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Dot product with an f64 accumulator.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum::<f64>() as f32
}

/// `x / sqrt(Σx² + eps)` in place: eps on the *sum* (qwen35moe.md §5, §10.6).
pub fn l2_norm(x: &mut [f32], eps: f32) {
    let ss: f64 = x.iter().map(|v| *v as f64 * *v as f64).sum();
    let scale = 1.0 / ((ss as f32) + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= scale);
}

/// RMSNorm of one group: `x / sqrt(mean(x²) + eps) * w`, sum of squares in f64 like ggml.
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|v| *v as f64 * *v as f64).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

pub fn matmul(w: &WeightView, x: &Mat) -> Mat {
    assert_eq!(x.d, w.k, "matmul: x has {} columns, weight rows have {}", x.d, w.k);
    let mut y = Mat::zeros(x.n, w.n_rows);
    let mut row = vec![0f32; w.k];
    for r in 0..w.n_rows {
        // unwrap: the view's rows are whole blocks of its type.
        ember_gguf::quant::dequantize(w.ty, w.row(r), &mut row).unwrap();
        for t in 0..x.n {
            y.data[t * w.n_rows + r] = dot(&row, x.row(t));
        }
    }
    y
}

/// The MoE FFN of [`crate::Ops::moe`], composed of `matmul` calls: per slot, gather its tokens,
/// SwiGLU of gate and up, down, and add `weight · y` to each token's row, in slot order.
pub fn moe(matmul: impl Fn(&WeightView, &Mat) -> Mat, slots: &[MoeSlot], x: &Mat) -> Mat {
    let d = slots.first().map_or(x.d, |s| s.expert.down.n_rows);
    let mut out = Mat::zeros(x.n, d);
    for slot in slots.iter().filter(|s| !s.tokens.is_empty()) {
        let mut xe = Mat::zeros(slot.tokens.len(), x.d);
        for (r, &(t, _)) in slot.tokens.iter().enumerate() {
            xe.row_mut(r).copy_from_slice(x.row(t));
        }
        let mut h = matmul(&slot.expert.gate, &xe); // [n_e, n_ff]
        let up = matmul(&slot.expert.up, &xe);
        h.data.iter_mut().zip(&up.data).for_each(|(g, u)| *g = silu(*g) * u);
        let y = matmul(&slot.expert.down, &h); // [n_e, D]
        for (r, &(t, w)) in slot.tokens.iter().enumerate() {
            out.row_mut(t).iter_mut().zip(y.row(r)).for_each(|(o, v)| *o += w * v);
        }
    }
    out
}

pub fn get_rows(w: &WeightView, ids: &[u32]) -> Mat {
    let mut out = Mat::zeros(ids.len(), w.k);
    for (i, &id) in ids.iter().enumerate() {
        // unwrap: ids were checked against n_rows by the caller (Batch validation).
        ember_gguf::quant::dequantize(w.ty, w.row(id as usize), out.row_mut(i)).unwrap();
    }
    out
}

pub fn rms_norm(x: &Mat, weight: &[f32], eps: f32) -> Mat {
    let g = weight.len();
    assert_eq!(x.d % g, 0, "rms_norm: width {} is not a multiple of the weight length {g}", x.d);
    let mut out = Mat::zeros(x.n, x.d);
    for (src, dst) in x.data.chunks_exact(g).zip(out.data.chunks_exact_mut(g)) {
        rms_norm_row(src, weight, eps, dst);
    }
    out
}

/// NeoX ("rotate half") RoPE on the first `n_rot` dims of every head (qwen35moe.md §6.3.4):
/// pairs (d, d + n_rot/2), angle `pos · base^(−2d/n_rot)`.
pub fn rope(x: &mut Mat, head_dim: usize, n_rot: usize, pos0: usize, base: f32) {
    let half = n_rot / 2;
    let inv_freq: Vec<f64> = (0..half).map(|d| (base as f64).powf(-2.0 * d as f64 / n_rot as f64)).collect();
    for t in 0..x.n {
        let p = (pos0 + t) as f64;
        let cs: Vec<(f32, f32)> = inv_freq.iter().map(|f| ((p * f).cos() as f32, (p * f).sin() as f32)).collect();
        for head in x.row_mut(t).chunks_exact_mut(head_dim) {
            for (d, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = (head[d], head[d + half]);
                head[d] = a * c - b * s;
                head[d + half] = a * s + b * c;
            }
        }
    }
}

pub fn conv1d_silu(x: &Mat, w: &[f32], state: &mut [f32]) -> Mat {
    let c = x.d;
    let kernel = w.len() / c;
    let hist = kernel - 1;
    assert_eq!(state.len(), hist * c, "conv state holds {} values, expected {}", state.len(), hist * c);
    // u(i) for i in -hist..n: the state, then the inputs.
    let input =
        |i: isize, ch: usize| -> f32 { if i < 0 { state[(hist as isize + i) as usize * c + ch] } else { x.data[i as usize * c + ch] } };
    let mut out = Mat::zeros(x.n, c);
    for t in 0..x.n {
        for ch in 0..c {
            let mut acc = 0f32;
            for j in 0..kernel {
                acc += w[ch * kernel + j] * input(t as isize - hist as isize + j as isize, ch);
            }
            out.data[t * c + ch] = silu(acc);
        }
    }
    let mut new_state = vec![0f32; hist * c];
    for s in 0..hist {
        let i = x.n as isize - hist as isize + s as isize;
        for ch in 0..c {
            new_state[s * c + ch] = input(i, ch);
        }
    }
    state.copy_from_slice(&new_state);
    out
}

/// Gated delta rule, token by token (qwen35moe.md §6.4 step 8). The state of value head h is
/// stored transposed, `st[jv * d_k + i] = S[i][jv]`, so each value index is a contiguous row:
/// S ← e^g S;  δ = β (v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀ q.
pub fn delta_rule_recurrent(s: DeltaShape, q: &Mat, k: &Mat, v: &Mat, g: &Mat, beta: &Mat, state: &mut [f32]) -> Mat {
    per_head(s, state, |h, st| delta_rule_head(s, h, q, k, v, g, beta, st, false))
}

/// Runs `f(h, state_of_h) -> o_h [n_tok * d_v]` for every value head and assembles the output.
fn per_head(s: DeltaShape, state: &mut [f32], mut f: impl FnMut(usize, &mut [f32]) -> Vec<f32>) -> Mat {
    let dv = s.d_v;
    let mut out = Mat::zeros(s.n_tok, s.n_v_head * dv);
    for (h, st) in state.chunks_exact_mut(dv * s.d_k).enumerate() {
        let o = f(h, st);
        scatter_head(&mut out, h, dv, &o);
    }
    out
}

/// Writes head `h`'s output `o` [n_tok * width] into columns h*width.. of `out`.
pub fn scatter_head(out: &mut Mat, h: usize, width: usize, o: &[f32]) {
    for t in 0..out.n {
        out.row_mut(t)[h * width..(h + 1) * width].copy_from_slice(&o[t * width..(t + 1) * width]);
    }
}

/// The delta rule for value head `h` (state `st` = that head's d_v × d_k block); returns its
/// output [n_tok * d_v]. Recurrent or chunked.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_head(s: DeltaShape, h: usize, q: &Mat, k: &Mat, v: &Mat, g: &Mat, beta: &Mat, st: &mut [f32], chunked: bool) -> Vec<f32> {
    let (dk, dv) = (s.d_k, s.d_v);
    let kh = h % s.n_k_head;
    let mut out = vec![0f32; s.n_tok * dv];
    if chunked {
        let mut t0 = 0;
        while t0 < s.n_tok {
            let c = CHUNK.min(s.n_tok - t0);
            let rows = |m: &Mat, off: usize, w: usize| -> Vec<f32> { (t0..t0 + c).flat_map(|t| m.row(t)[off..off + w].to_vec()).collect() };
            let qc = rows(q, kh * dk, dk);
            let kc = rows(k, kh * dk, dk);
            let vc = rows(v, h * dv, dv);
            let bc: Vec<f32> = (t0..t0 + c).map(|t| beta.row(t)[h]).collect();
            let mut gc: Vec<f32> = (t0..t0 + c).map(|t| g.row(t)[h]).collect();
            for i in 1..c {
                gc[i] += gc[i - 1]; // G_i: cumulative log-decay
            }
            let chunk = Chunk { c, dk, dv, q: &qc, k: &kc, v: &vc, beta: &bc, g_cum: &gc };
            let a = chunk.kkt();
            let t = chunk.solve_tril(&a);
            let (u, w) = chunk.wy(&t);
            let v_new = chunk.v_new(&u, &w, st);
            let o = chunk.out(st, &v_new);
            chunk.state(st, &v_new);
            out[t0 * dv..(t0 + c) * dv].copy_from_slice(&o);
            t0 += c;
        }
        return out;
    }
    for t in 0..s.n_tok {
        let qt = &q.row(t)[kh * dk..(kh + 1) * dk];
        let kt = &k.row(t)[kh * dk..(kh + 1) * dk];
        let vt = &v.row(t)[h * dv..(h + 1) * dv];
        let decay = g.row(t)[h].exp();
        let b = beta.row(t)[h];
        for jv in 0..dv {
            let row = &mut st[jv * dk..(jv + 1) * dk];
            row.iter_mut().for_each(|x| *x *= decay);
            let delta = b * (vt[jv] - dot(row, kt));
            row.iter_mut().zip(kt).for_each(|(x, kk)| *x += kk * delta);
            out[t * dv + jv] = dot(row, qt);
        }
    }
    out
}

/// Chunk length of the chunked delta rule (HF and llama.cpp use 64).
pub const CHUNK: usize = 64;

/// Gated delta rule in chunked (WY) form, qwen35moe.md §6.5; equal to the recurrent form up to
/// rounding. Per value head and chunk: `kkt` → `solve_tril` → `wy` → `out` → `state`.
pub fn delta_rule_chunked(s: DeltaShape, q: &Mat, k: &Mat, v: &Mat, g: &Mat, beta: &Mat, state: &mut [f32]) -> Mat {
    per_head(s, state, |h, st| delta_rule_head(s, h, q, k, v, g, beta, st, true))
}

/// One chunk of one head: rows are tokens, `g_cum` the cumulative log-decay G.
struct Chunk<'a> {
    c: usize,
    dk: usize,
    dv: usize,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    beta: &'a [f32],
    g_cum: &'a [f32],
}

impl Chunk<'_> {
    fn krow(&self, i: usize) -> &[f32] {
        &self.k[i * self.dk..(i + 1) * self.dk]
    }

    /// exp(G_i − G_j) for j ≤ i: always the exponent of a difference ≤ 0 (§10.3).
    fn decay(&self, i: usize, j: usize) -> f32 {
        (self.g_cum[i] - self.g_cum[j]).exp()
    }

    /// A_ij = β_i (k_i·k_j) exp(G_i − G_j) for j < i (strictly lower triangular, c×c).
    fn kkt(&self) -> Vec<f32> {
        let c = self.c;
        let mut a = vec![0f32; c * c];
        for i in 0..c {
            for j in 0..i {
                a[i * c + j] = self.beta[i] * dot(self.krow(i), self.krow(j)) * self.decay(i, j);
            }
        }
        a
    }

    /// T = (I + A)⁻¹ by forward substitution: T_i = e_i − Σ_{j<i} A_ij T_j.
    fn solve_tril(&self, a: &[f32]) -> Vec<f32> {
        let c = self.c;
        let mut t = vec![0f32; c * c];
        for i in 0..c {
            t[i * c + i] = 1.0;
            for j in 0..i {
                let aij = a[i * c + j];
                if aij != 0.0 {
                    for m in 0..=j {
                        t[i * c + m] -= aij * t[j * c + m];
                    }
                }
            }
        }
        t
    }

    /// U = T·diag(β)·V (c×dv) and W = T·diag(β_i e^{G_i})·K (c×dk).
    fn wy(&self, t: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (c, dk, dv) = (self.c, self.dk, self.dv);
        let mut u = vec![0f32; c * dv];
        let mut w = vec![0f32; c * dk];
        for i in 0..c {
            for j in 0..=i {
                let tij = t[i * c + j];
                if tij == 0.0 {
                    continue;
                }
                let bu = tij * self.beta[j];
                let bw = bu * self.g_cum[j].exp();
                for m in 0..dv {
                    u[i * dv + m] += bu * self.v[j * dv + m];
                }
                for m in 0..dk {
                    w[i * dk + m] += bw * self.k[j * dk + m];
                }
            }
        }
        (u, w)
    }

    /// V' = U − W·S, with S stored transposed (`st[jv * dk + i]`).
    fn v_new(&self, u: &[f32], w: &[f32], st: &[f32]) -> Vec<f32> {
        let (c, dk, dv) = (self.c, self.dk, self.dv);
        let mut vn = u.to_vec();
        for i in 0..c {
            let wi = &w[i * dk..(i + 1) * dk];
            for jv in 0..dv {
                vn[i * dv + jv] -= dot(wi, &st[jv * dk..(jv + 1) * dk]);
            }
        }
        vn
    }

    /// O_i = e^{G_i} Sᵀq_i + Σ_{j≤i} (q_i·k_j) e^{G_i − G_j} V'_j.
    fn out(&self, st: &[f32], vn: &[f32]) -> Vec<f32> {
        let (c, dk, dv) = (self.c, self.dk, self.dv);
        let mut o = vec![0f32; c * dv];
        for i in 0..c {
            let qi = &self.q[i * dk..(i + 1) * dk];
            let gi = self.g_cum[i].exp();
            for jv in 0..dv {
                o[i * dv + jv] = gi * dot(qi, &st[jv * dk..(jv + 1) * dk]);
            }
            for j in 0..=i {
                let coef = dot(qi, self.krow(j)) * self.decay(i, j);
                for jv in 0..dv {
                    o[i * dv + jv] += coef * vn[j * dv + jv];
                }
            }
        }
        o
    }

    /// S ← e^{G_c} S + Σ_i e^{G_c − G_i} k_i V'_iᵀ.
    fn state(&self, st: &mut [f32], vn: &[f32]) {
        let (c, dk, dv) = (self.c, self.dk, self.dv);
        let last = c - 1;
        let total = self.g_cum[last].exp();
        st.iter_mut().for_each(|x| *x *= total);
        for i in 0..c {
            let f = self.decay(last, i);
            let ki = self.krow(i);
            for jv in 0..dv {
                let coef = f * vn[i * dv + jv];
                let row = &mut st[jv * dk..(jv + 1) * dk];
                row.iter_mut().zip(ki).for_each(|(x, kk)| *x += coef * kk);
            }
        }
    }
}

/// Causal GQA attention with an online softmax: query head n reads KV head
/// n / (n_head / n_head_kv); token t sees positions 0..=pos0+t.
pub fn attention(s: AttnShape, q: &Mat, k: &KvRows, v: &KvRows) -> Mat {
    let mut out = Mat::zeros(s.n_tok, s.n_head * s.head_dim);
    for n in 0..s.n_head {
        let o = attention_head(s, n, q, k, v);
        scatter_head(&mut out, n, s.head_dim, &o);
    }
    out
}

/// Attention output of query head `n` for every token: [n_tok * head_dim].
pub fn attention_head(s: AttnShape, n: usize, q: &Mat, k: &KvRows, v: &KvRows) -> Vec<f32> {
    let hd = s.head_dim;
    let kvh = n / (s.n_head / s.n_head_kv);
    let mut out = vec![0f32; s.n_tok * hd];
    let mut kr = vec![0f32; hd];
    let mut vr = vec![0f32; hd];
    let mut acc = vec![0f64; hd];
    for t in 0..s.n_tok {
        let qn = &q.row(t)[n * hd..(n + 1) * hd];
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f64);
        acc.fill(0.0);
        for p in 0..s.pos0 + t + 1 {
            k.read(p, kvh * hd, &mut kr);
            let score = dot(qn, &kr) * s.scale;
            let m_new = m.max(score);
            let corr = ((m - m_new) as f64).exp();
            let e = ((score - m_new) as f64).exp();
            v.read(p, kvh * hd, &mut vr);
            l = l * corr + e;
            for (a, x) in acc.iter_mut().zip(&vr) {
                *a = *a * corr + e * *x as f64;
            }
            m = m_new;
        }
        for (o, a) in out[t * hd..(t + 1) * hd].iter_mut().zip(&acc) {
            *o = (*a / l) as f32;
        }
    }
    out
}

/// `h ← h + x` ([`crate::Ops::add`]).
pub fn add(h: &mut Mat, x: &Mat) {
    h.data.iter_mut().zip(&x.data).for_each(|(a, b)| *a += b);
}

/// Rows `rows` of `x` ([`crate::Ops::select_rows`]).
pub fn select_rows(x: &Mat, rows: &[usize]) -> Mat {
    let mut data = Vec::with_capacity(rows.len() * x.d);
    for &r in rows {
        data.extend_from_slice(x.row(r));
    }
    Mat::from_vec(rows.len(), x.d, data)
}

/// [`crate::Ops::attn_prep`]: split per head `[q | gate]`, per-head RMSNorm of q and k, NeoX
/// RoPE at each row's position. `q_norm`, `k_norm` are the head_dim-wide norm weights.
pub fn attn_prep(s: &AttnPrep, q_norm: &[f32], k_norm: &[f32], qg: &Mat, k: &Mat, pos: &[u32]) -> AttnMats {
    let (hd, nh) = (s.head_dim, s.n_head);
    let (mut q, mut gate) = (Vec::with_capacity(qg.n * nh * hd), Vec::with_capacity(qg.n * nh * hd));
    for head in qg.data.chunks_exact(2 * hd) {
        q.extend_from_slice(&head[..hd]);
        gate.extend_from_slice(&head[hd..]);
    }
    let (q, gate) = (Mat::from_vec(qg.n, nh * hd, q), Mat::from_vec(qg.n, nh * hd, gate));
    let mut q = rms_norm(&q, q_norm, s.eps);
    let mut k = rms_norm(k, k_norm, s.eps);
    rope_at(&mut q, hd, s.n_rot, pos, s.rope_base);
    rope_at(&mut k, hd, s.n_rot, pos, s.rope_base);
    AttnMats { q, gate, k }
}

/// [`rope`] with one position per row (the same angles, computed the same way).
pub fn rope_at(x: &mut Mat, head_dim: usize, n_rot: usize, pos: &[u32], base: f32) {
    let inv_freq = rope_inv_freq(n_rot, base);
    let mut cs = vec![(0f32, 0f32); n_rot / 2];
    for (t, &p) in pos.iter().enumerate().take(x.n) {
        rope_row(x.row_mut(t), head_dim, p, &inv_freq, &mut cs);
    }
}

/// RoPE's frequencies for `n_rot` rotated dims: base^(−2d / n_rot), d < n_rot / 2, in f64.
pub fn rope_inv_freq(n_rot: usize, base: f32) -> Vec<f64> {
    (0..n_rot / 2).map(|d| (base as f64).powf(-2.0 * d as f64 / n_rot as f64)).collect()
}

/// [`rope_at`] of one row at position `p` (every head of `head_dim` in it; NeoX pairing of the
/// first 2·inv_freq.len() dims); `cs` is scratch of inv_freq.len() pairs.
pub fn rope_row(row: &mut [f32], head_dim: usize, p: u32, inv_freq: &[f64], cs: &mut [(f32, f32)]) {
    let half = inv_freq.len();
    let p = p as f64;
    for (c, f) in cs.iter_mut().zip(inv_freq) {
        *c = ((p * f).cos() as f32, (p * f).sin() as f32);
    }
    for head in row.chunks_exact_mut(head_dim) {
        for (d, &(c, s)) in cs.iter().enumerate().take(half) {
            let (a, b) = (head[d], head[d + half]);
            head[d] = a * c - b * s;
            head[d + half] = a * s + b * c;
        }
    }
}

/// [`crate::Ops::delta_prep`]: q | k | v split of the conv output, L2 norms (q scaled by
/// 1/√d_k), β = sigmoid(b), g = a·softplus(alpha + dt_bias) ≤ 0 (qwen35moe.md §6.4).
pub fn delta_prep(s: &DeltaPrep, a: &[f32], dt_bias: &[f32], cu: &Mat, b: &Mat, alpha: &Mat) -> DeltaMats {
    let (nk, dk) = (s.n_k_head, s.d_k);
    let mut q = cu.cols(0, nk * dk);
    let mut k = cu.cols(nk * dk, nk * dk);
    let v = cu.cols(2 * nk * dk, s.n_v_head * s.d_v);
    let q_scale = 1.0 / (dk as f32).sqrt();
    for head in q.data.chunks_exact_mut(dk) {
        l2_norm(head, s.eps);
        head.iter_mut().for_each(|x| *x *= q_scale);
    }
    for head in k.data.chunks_exact_mut(dk) {
        l2_norm(head, s.eps);
    }
    let mut beta = b.clone();
    beta.data.iter_mut().for_each(|x| *x = sigmoid(*x));
    let mut g = alpha.clone();
    for t in 0..g.n {
        for (h, x) in g.row_mut(t).iter_mut().enumerate() {
            *x = a[h] * softplus(*x + dt_bias[h]);
        }
    }
    DeltaMats { q, k, v, g, beta }
}

/// The smallest normal f16: llama.cpp clamps the routing weights' sum to it before
/// renormalising (qwen35moe.md §6.6).
pub const ROUTE_SUM_MIN: f32 = 6.103_515_6e-5;

/// [`crate::Ops::route`]: softmax over all experts (f64 sum), the `k` largest (ties to the lower
/// id, largest first), weights renormalised by their sum (clamped to [`ROUTE_SUM_MIN`]).
pub fn route(logits: &Mat, k: usize) -> RouteTable {
    let k = k.min(logits.d);
    let mut ids = Vec::with_capacity(logits.n * k);
    let mut weights = Vec::with_capacity(logits.n * k);
    let mut p = vec![0f32; logits.d];
    let mut sel = vec![0usize; k];
    for t in 0..logits.n {
        softmax(logits.row(t), &mut p);
        top_k(&p, &mut sel);
        let sum: f32 = sel.iter().map(|&e| p[e]).sum();
        let norm = sum.max(ROUTE_SUM_MIN);
        for &e in &sel {
            ids.push(ExpertId(e as u16));
            weights.push(p[e] / norm);
        }
    }
    RouteTable { n_tok: logits.n, k, ids, weights }
}

/// Softmax of one row, the sum in f64.
pub fn softmax(x: &[f32], out: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    out.iter_mut().zip(x).for_each(|(o, v)| *o = (v - m).exp());
    let s: f64 = out.iter().map(|v| *v as f64).sum();
    out.iter_mut().for_each(|v| *v = (*v as f64 / s) as f32);
}

/// The `sel.len()` largest entries of `p`, largest first, ties to the lower index (the order a
/// stable descending sort gives).
pub fn top_k(p: &[f32], sel: &mut [usize]) {
    if sel.is_empty() {
        return;
    }
    let mut n = 0;
    for (e, &v) in p.iter().enumerate() {
        if n == sel.len() && p[sel[n - 1]].total_cmp(&v).is_ge() {
            continue;
        }
        let mut i = n.min(sel.len() - 1);
        while i > 0 && p[sel[i - 1]].total_cmp(&v).is_lt() {
            sel[i] = sel[i - 1];
            i -= 1;
        }
        sel[i] = e;
        n = (n + 1).min(sel.len());
    }
}

/// Tokens (rows of x) and their weights for one expert.
pub type TokenWeights = Vec<(usize, f32)>;

/// The token lists of a MoE call: per used expert (increasing id) its tokens and weights, then
/// the shared expert with sigmoid(shared_gate[t]) for every token. [`moe_slots`] pairs them
/// with the expert weights.
pub fn moe_tokens(routing: &RouteTable, n_expert: usize, shared_gate: &Mat) -> (Vec<(ExpertId, TokenWeights)>, TokenWeights) {
    let routed = routing
        .per_expert(n_expert)
        .into_iter()
        .enumerate()
        .filter(|(_, toks)| !toks.is_empty())
        .map(|(e, toks)| (ExpertId(e as u16), toks))
        .collect();
    let shared = (0..shared_gate.n).map(|t| (t, sigmoid(shared_gate.row(t)[0]))).collect();
    (routed, shared)
}
