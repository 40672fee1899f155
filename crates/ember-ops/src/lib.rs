//! The op set every backend implements, the tensor and weight handles it works on, and a
//! scalar reference implementation of each op (the spec in code).
//!
//! Model code (`ember-model`) is written only against the [`Ops`] trait. Every method has a
//! default body that calls the scalar reference in [`reference`], so a backend overrides
//! exactly the ops it accelerates and inherits a correct version of the rest. The decision a
//! reader may question: activations are plain host `Vec<f32>` matrices ([`Mat`]), not
//! device handles. Weights carry their device ([`WeightView::device`]) so placement can come
//! later, and a GPU backend will move `x` to the weight's device inside `matmul`.

#![forbid(unsafe_code)]

pub mod reference;

use ember_gguf::GgmlType;

/// A row-major matrix of activations: `n` rows (usually tokens) of `d` values.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Mat {
    pub n: usize,
    pub d: usize,
    pub data: Vec<f32>,
}

impl Mat {
    pub fn zeros(n: usize, d: usize) -> Self {
        Mat { n, d, data: vec![0.0; n * d] }
    }

    pub fn from_vec(n: usize, d: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), n * d, "Mat::from_vec: {} values for {n}x{d}", data.len());
        Mat { n, d, data }
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.d..(i + 1) * self.d]
    }

    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[i * self.d..(i + 1) * self.d]
    }

    /// Rows `start..start + n`, as a new matrix.
    pub fn rows(&self, start: usize, n: usize) -> Mat {
        Mat::from_vec(n, self.d, self.data[start * self.d..(start + n) * self.d].to_vec())
    }

    /// Overwrites rows `start..start + src.n` with `src`.
    pub fn set_rows(&mut self, start: usize, src: &Mat) {
        assert_eq!(src.d, self.d, "set_rows: width {} into {}", src.d, self.d);
        self.data[start * self.d..(start + src.n) * self.d].copy_from_slice(&src.data);
    }

    /// Columns `start..start + width` of every row, as a new matrix.
    pub fn cols(&self, start: usize, width: usize) -> Mat {
        let mut data = Vec::with_capacity(self.n * width);
        for i in 0..self.n {
            data.extend_from_slice(&self.row(i)[start..start + width]);
        }
        Mat::from_vec(self.n, width, data)
    }
}

/// Where a weight lives. Only the host exists today; the placement layer adds GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    #[default]
    Host,
}

/// A 2-D weight in its file format: `n_rows` rows of `k` weights of type `ty`, borrowed from
/// the memory-mapped file. `y = W·x` means `y[r] = Σ_j W[r][j]·x[j]` (torch Linear).
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub ty: GgmlType,
    pub k: usize,
    pub n_rows: usize,
    pub data: &'a [u8],
    pub device: Device,
}

impl<'a> WeightView<'a> {
    #[inline]
    pub fn row_bytes(&self) -> usize {
        // unwrap: views are built only from validated tensors whose k is a block multiple.
        self.ty.row_bytes(self.k).unwrap()
    }

    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        let b = self.row_bytes();
        &self.data[r * b..(r + 1) * b]
    }

    /// Rows `start..start + n` as a view (e.g. one expert of a stacked expert tensor).
    pub fn rows(&self, start: usize, n: usize) -> WeightView<'a> {
        let b = self.row_bytes();
        WeightView { data: &self.data[start * b..(start + n) * b], n_rows: n, ..*self }
    }
}

/// How a KV cache stores K and V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    F32,
    F16,
    Q8_0,
}

impl KvType {
    pub fn ggml(self) -> GgmlType {
        match self {
            KvType::F32 => GgmlType::F32,
            KvType::F16 => GgmlType::F16,
            KvType::Q8_0 => GgmlType::Q8_0,
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(KvType::F32),
            "f16" => Some(KvType::F16),
            "q8_0" => Some(KvType::Q8_0),
            _ => None,
        }
    }
}

/// The K or V rows of one attention layer of one sequence, stored in `ty` blocks: row `p` is
/// position `p`, holding `n_head_kv * head_dim` values.
#[derive(Debug, Clone)]
pub struct KvRows {
    pub ty: KvType,
    pub width: usize,
    pub len: usize,
    pub bytes: Vec<u8>,
}

impl KvRows {
    pub fn new(ty: KvType, width: usize) -> Self {
        KvRows { ty, width, len: 0, bytes: Vec::new() }
    }

    #[inline]
    pub fn row_bytes(&self) -> usize {
        // unwrap: width is a multiple of 32 (checked by the model loader for q8_0).
        self.ty.ggml().row_bytes(self.width).unwrap()
    }

    /// Appends rows (quantised to the cache type).
    pub fn push(&mut self, rows: &Mat) -> Result<(), ember_gguf::Error> {
        let rb = self.row_bytes();
        let start = self.bytes.len();
        self.bytes.resize(start + rows.n * rb, 0);
        for i in 0..rows.n {
            let dst = &mut self.bytes[start + i * rb..start + (i + 1) * rb];
            match self.ty {
                KvType::F32 => {
                    for (d, x) in dst.chunks_exact_mut(4).zip(rows.row(i)) {
                        d.copy_from_slice(&x.to_le_bytes());
                    }
                }
                KvType::F16 => {
                    for (d, x) in dst.chunks_exact_mut(2).zip(rows.row(i)) {
                        d.copy_from_slice(&half::f16::from_f32(*x).to_le_bytes());
                    }
                }
                KvType::Q8_0 => ember_gguf::quant::quantize(self.ty.ggml(), rows.row(i), dst)?,
            }
        }
        self.len += rows.n;
        Ok(())
    }

    /// Drops every row from `len` on.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.bytes.truncate(len * self.row_bytes());
        }
    }

    /// Values `start..start + out.len()` of row `p`, as f32.
    pub fn read(&self, p: usize, start: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let row = &self.bytes[p * rb..(p + 1) * rb];
        match self.ty {
            KvType::F32 => {
                for (o, b) in out.iter_mut().zip(row[start * 4..].chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
                return;
            }
            KvType::F16 => {
                for (o, b) in out.iter_mut().zip(row[start * 2..].chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
                return;
            }
            KvType::Q8_0 => {}
        }
        let ty = self.ty.ggml();
        let bs = ty.block_size();
        // head slices start on block boundaries (head_dim is a multiple of 32).
        let b0 = start / bs * ty.type_size();
        let b1 = (start + out.len()) / bs * ty.type_size();
        // unwrap: the slice is a whole number of blocks matching out.len().
        ember_gguf::quant::dequantize(ty, &row[b0..b1], out).unwrap();
    }
}

/// One expert of a mixture-of-experts FFN: gate and up {D -> n_ff}, down {n_ff -> D}
/// (qwen35moe.md §6.6 step 4). For a fused gate_up tensor, `gate` and `up` are its two row
/// ranges.
#[derive(Debug, Clone, Copy)]
pub struct ExpertView<'a> {
    pub gate: WeightView<'a>,
    pub up: WeightView<'a>,
    pub down: WeightView<'a>,
}

/// An expert and the tokens routed to it: `(row of x, weight)`, rows in increasing order.
#[derive(Debug, Clone, Copy)]
pub struct MoeSlot<'a> {
    pub expert: ExpertView<'a>,
    pub tokens: &'a [(usize, f32)],
}

/// Shape of a gated delta rule call (DeltaNet, qwen35moe.md §6.4).
#[derive(Debug, Clone, Copy)]
pub struct DeltaShape {
    pub n_tok: usize,
    /// key/query heads (16 in the 35B model)
    pub n_k_head: usize,
    /// value heads (32); value head h uses key head h % n_k_head (GGUF tiled order)
    pub n_v_head: usize,
    pub d_k: usize,
    pub d_v: usize,
}

/// Shape of an attention call over a KV cache (qwen35moe.md §6.3).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_tok: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Position of the first query token; keys 0..=pos0+t are visible to token t.
    pub pos0: usize,
    pub scale: f32,
}

/// The activation of an output gate ([`Ops::gate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Silu,
    Sigmoid,
}

/// The op set. Each method documents shapes; the default body is the scalar reference.
pub trait Ops: Send + Sync {
    fn name(&self) -> &'static str;

    /// `y[t] = W·x[t]` for every row of `x` ([n, w.k] -> [n, w.n_rows]).
    fn matmul(&self, w: &WeightView, x: &Mat) -> Mat {
        reference::matmul(w, x)
    }

    /// `[W_i·x]` for several weights that read the same input (e.g. the four DeltaNet input
    /// projections): a backend quantises `x` once and runs them as one parallel region.
    fn matmul_many(&self, ws: &[WeightView], x: &Mat) -> Vec<Mat> {
        ws.iter().map(|w| self.matmul(w, x)).collect()
    }

    /// Mixture-of-experts FFN over already routed tokens (qwen35moe.md §6.6 steps 4–7):
    /// `y[t] = Σ_{slots s routing t with weight ω} ω · down_s(silu(gate_s·x_t) ⊙ (up_s·x_t))`,
    /// summed in slot order. The shared expert is one more slot. Returns [x.n, D].
    fn moe(&self, slots: &[MoeSlot], x: &Mat) -> Mat {
        reference::moe(|w, x| self.matmul(w, x), slots, x)
    }

    /// Rows `ids` of an embedding table, dequantised ([ids.len(), w.k]).
    fn get_rows(&self, w: &WeightView, ids: &[u32]) -> Mat {
        reference::get_rows(w, ids)
    }

    /// RMSNorm of every `weight.len()`-wide group of every row, times `weight`.
    fn rms_norm(&self, x: &Mat, weight: &[f32], eps: f32) -> Mat {
        reference::rms_norm(x, weight, eps)
    }

    /// NeoX RoPE on the first `n_rot` dims of each `head_dim`-wide head; row t is at
    /// position `pos0 + t`.
    fn rope(&self, x: &mut Mat, head_dim: usize, n_rot: usize, pos0: usize, base: f32) {
        reference::rope(x, head_dim, n_rot, pos0, base)
    }

    /// Causal depthwise conv (kernel `w.len() / channels`) over `[state | x]`, then SiLU.
    /// `state` holds the last kernel-1 inputs (oldest first) and is updated.
    fn conv1d_silu(&self, x: &Mat, w: &[f32], state: &mut [f32]) -> Mat {
        reference::conv1d_silu(x, w, state)
    }

    /// Gated delta rule over `n_tok` tokens; `q` is already L2-normed and scaled, `k`
    /// L2-normed. `state` holds one `d_v x d_k` matrix per value head (row jv = value index).
    /// Returns o [n_tok, n_v_head * d_v].
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(&self, s: DeltaShape, q: &Mat, k: &Mat, v: &Mat, g: &Mat, beta: &Mat, state: &mut [f32], chunked: bool) -> Mat {
        if chunked {
            reference::delta_rule_chunked(s, q, k, v, g, beta, state)
        } else {
            reference::delta_rule_recurrent(s, q, k, v, g, beta, state)
        }
    }

    /// `y ← y ⊙ act(g)` element by element (same shapes): the output gates of the DeltaNet
    /// (SiLU of z) and of gated attention (sigmoid).
    fn gate(&self, y: &mut Mat, g: &Mat, act: Gate) {
        reference::gate(y, g, act)
    }

    /// Causal GQA attention of `q` [n_tok, n_head*head_dim] over cached K/V rows.
    fn attention(&self, s: AttnShape, q: &Mat, k: &KvRows, v: &KvRows) -> Mat {
        reference::attention(s, q, k, v)
    }
}

/// The scalar reference backend: every op as written in [`reference`], one thread.
#[derive(Debug, Default, Clone, Copy)]
pub struct RefOps;

impl Ops for RefOps {
    fn name(&self) -> &'static str {
        "reference"
    }
}
