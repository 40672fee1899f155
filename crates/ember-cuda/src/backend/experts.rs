//! The routed experts of [`CudaOps`]: which ones a layer holds (the expert tier's residency),
//! the MoE op over them, and the streamed path that uploads a prompt batch's missing experts.

use ember_ops::{ExpertId, LayerIdx, OpError, OpResult, RouteTable, Routing, Tensor, check};

use super::arena::Parts;
use super::{CudaOps, cuda, shape_of};
use crate::ops::{Act, DeviceWeight, MOE_MISS, MoeExperts, MoeRouting, MoeSharedQ8, MoeSlots, SharedWeights, moe_scratch_len};
use crate::{Buf, Mailbox};

/// Where [`CudaOps::moe_streamed`] puts a batch's experts: `n_slots` experts stacked like a
/// layer's, and each expert's slot.
pub(super) struct StreamScratch {
    gate: DeviceWeight,
    up: DeviceWeight,
    down: DeviceWeight,
    slot_of: Buf<u32>,
    n_slots: usize,
}

impl CudaOps {
    /// Which routed experts each MoE layer keeps on this GPU, for the next [`ember_ops::Ops::register`]:
    /// per layer, None for all of them, or the list (then its MoE computes only the pairs
    /// routed to those; the others add nothing, and the caller adds their sum: the expert tier's
    /// misses). Layers past the list's end hold all their experts.
    pub fn set_resident_experts(&mut self, layers: Vec<Option<Vec<u16>>>) {
        self.resident = layers;
    }

    /// Which weights the next [`ember_ops::Ops::register`] uploads, by id (None: all of them): a part of a
    /// layer split (`ember_plan::split::part_weights`) keeps its own layers' weights; an op that
    /// names a weight not kept is an error ("not registered").
    pub fn set_weights_kept(&mut self, kept: Option<Vec<bool>>) {
        self.kept = kept;
    }

    /// Per expert of `layer`, its slot on this GPU or [`crate::ops::MOE_MISS`]; None when the
    /// layer holds all its experts.
    pub fn expert_slots(&self, layer: LayerIdx) -> Option<&[u32]> {
        self.weights.pools.get(layer.index()).and_then(Option::as_ref).map(|p| p.slot_of.as_slice())
    }

    /// Starts moving expert `e` of `layer` onto this GPU into `slot`, replacing the expert
    /// there, which is a miss from now on; e is one once its copies on the copy stream are done
    /// and [`CudaOps::finish_uploads`] has seen it (until then its pairs are misses too, and
    /// neither the slot nor e can be placed again). Nothing waits; not inside a step.
    pub fn place_expert(&mut self, layer: LayerIdx, slot: usize, e: ExpertId) -> OpResult<()> {
        self.weights.place_expert(&self.gpu, layer, slot, e)
    }

    /// Puts the experts whose uploads are done into their slot tables (all of them, waiting
    /// for their copies, with `wait`); returns how many. Not inside a step.
    pub fn finish_uploads(&mut self, wait: bool) -> OpResult<usize> {
        self.weights.finish_uploads(&self.gpu, wait)
    }

    /// The (slot, expert) pairs of `layer` on their way in.
    pub fn uploading(&self, layer: LayerIdx) -> Vec<(usize, u16)> {
        self.weights.uploading(layer)
    }

    /// Makes `layer` hold exactly the routed experts `list` (its expert tensors are freed, then
    /// uploaded again with those; synchronous, not inside a step): the tier's shrink under
    /// memory pressure and its growth back. On an error the layer may hold none of its experts
    /// (a later call with a shorter list can still succeed).
    pub fn set_layer_experts(&mut self, layer: LayerIdx, list: Vec<u16>) -> OpResult<()> {
        self.release_stream_scratch();
        self.weights.set_layer_experts(&self.gpu, layer, list)
    }

    /// The expert in each slot of `layer` (None when it holds all).
    pub fn slot_experts(&self, layer: LayerIdx) -> Option<&[u16]> {
        self.weights.pools.get(layer.index()).and_then(Option::as_ref).map(|p| p.experts.as_slice())
    }

    /// This step's generation, bumped by every `begin_step`: what a mailbox's
    /// [`Mailbox::routed`] reads once this step's [`CudaOps::moe_post`] has run.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// A mailbox for routings of up to `cap_pairs` pairs and `cap_x` floats of x.
    pub fn mailbox(&self, cap_pairs: usize, cap_x: usize) -> OpResult<Mailbox> {
        self.gpu.mailbox(cap_pairs, cap_x).map_err(cuda("mailbox", self.dev))
    }

    /// Queues the publication of `routing` (and `x`, when some pair misses) in `mb` for the
    /// host, tagged with this step's generation: the expert tier's decode layer without a
    /// wait (kernels/mailbox.cu). `layer` must hold only some of its experts.
    pub fn moe_post(&mut self, layer: LayerIdx, routing: Routing, x: Tensor, mb: &Mailbox) -> OpResult<()> {
        const OP: &str = "moe_post";
        self.settle_route(OP, routing)?;
        let dev = self.dev;
        let m = *self.weights.reg.moe(OP, layer)?;
        self.arena.check(OP, x)?;
        let (rb, _) = self.routes.get(OP, routing)?;
        let Some(pool) = self.weights.pools.get(layer.index()).and_then(Option::as_ref) else {
            return Err(OpError::new(OP, dev, format!("{layer}"), "the layer holds all its experts"));
        };
        if x.n != routing.n_tok {
            return Err(OpError::new(OP, dev, format!("x {}x{}", x.n, x.d), format!("a routing of {} tokens", routing.n_tok)));
        }
        let routed = MoeRouting { ids: &rb.ids, weights: &rb.weights, k: routing.k };
        let xb = self.arena.buf(OP, x)?;
        self.gpu.moe_post(routed, routing.n_tok, xb, x.n * x.d, &pool.dev, m.n_expert, &self.step.generation, mb).map_err(cuda(OP, dev))
    }

    /// Queues `out += ` the host's answer in `mb`, waited for only when this step's
    /// [`CudaOps::moe_post`] on `mb` found misses.
    pub fn moe_wait_add(&mut self, out: Tensor, mb: &Mailbox) -> OpResult<()> {
        const OP: &str = "moe_wait_add";
        if self.q8_x.is_some_and(|(id, _)| id == out.id) {
            self.q8_x = None;
        }
        let ob = self.arena.buf_mut(OP, out)?;
        self.gpu.moe_wait_add(ob, out.n * out.d, &self.step.generation, mb).map_err(cuda(OP, self.dev))
    }

    /// The MoE op with the layer's own experts, or (`streamed`) with the experts
    /// [`CudaOps::moe_streamed`] just put in the stream scratch.
    pub(super) fn moe_on(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor, streamed: bool) -> OpResult<Tensor> {
        const OP: &str = "moe";
        let dev = self.dev;
        // One MoE output waits for its sum at a time: an earlier one still pending is summed now.
        self.settle_any(OP)?;
        let m = *self.weights.reg.moe(OP, layer)?;
        let (_, routed_over) = self.routes.get_any(OP, routing)?;
        self.arena.check(OP, x)?;
        self.arena.check(OP, shared_gate)?;
        let nk = routing.n_tok * routing.k;
        let table = RouteTable { n_tok: routing.n_tok, k: routing.k, ids: vec![ExpertId(0); nk], weights: vec![0.0; nk] };
        check::moe(OP, dev, &shape_of(x), &table, &shape_of(shared_gate), m.n_expert)?;
        if routed_over > m.n_expert {
            return Err(OpError::new(
                OP,
                dev,
                format!("routing {}x{} over {routed_over} experts", routing.n_tok, routing.k),
                format!("{layer} has {} experts", m.n_expert),
            ));
        }
        let (gate, up, down, slots) = match (&self.stream, streamed) {
            (Some(st), true) => (&st.gate, &st.up, &st.down, Some(MoeSlots { slot_of: &st.slot_of, n_slots: st.n_slots })),
            (None, true) => return Err(OpError::new(OP, dev, format!("{layer}"), "no experts were streamed")),
            (_, false) => {
                let (gate, up) = self.weights.gate_up(OP, m.gate_up)?;
                let down = self.weights.matrix(OP, m.down)?.1;
                let pool = self.weights.pools.get(layer.index()).and_then(Option::as_ref);
                (gate, up, down, pool.map(|p| MoeSlots { slot_of: &p.dev, n_slots: p.experts.len() }))
            }
        };
        let n_slots = slots.map_or(m.n_expert, |s| s.n_slots);
        let [sg, su, sd] = m.shared;
        let (sg, su, sd) = (self.weights.matrix(OP, sg)?.1, self.weights.matrix(OP, su)?.1, self.weights.matrix(OP, sd)?.1);
        let d_out = sd.n_rows;
        let chain = gate.k == x.d
            && up.k == x.d
            && gate.n_rows == n_slots * m.n_ff
            && up.n_rows == gate.n_rows
            && down.k == m.n_ff
            && down.n_rows == n_slots * d_out
            && sg.k == x.d
            && su.k == x.d
            && sg.n_rows == su.n_rows
            && sd.k == sg.n_rows;
        if !chain {
            return Err(OpError::new(OP, dev, format!("x {}x{}, {layer}", x.n, x.d), "expert shapes do not chain"));
        }
        let (n, n_ffs) = (x.n, sg.n_rows);
        let held = self.q8_holds(x);
        let (gpu, arena, prec) = (&self.gpu, &mut self.arena, self.precision);
        let experts = MoeExperts { gate, up, down, n_expert: m.n_expert, slots };
        let q8 = |w: &DeviceWeight| gpu.uses_gemv_q8(w.ty, w.k, n, prec);
        let int8 = q8(sg) && q8(su) && gpu.moe_uses_q8(experts, prec) && !gpu.moe_grouped(n, m.n_expert, prec);
        // One token, every expert here: the whole MoE in one launch where it applies
        // (moe_fused_q8: each expert's output a row of `parts`, summed by what reads `out`).
        let fused = int8 && n == 1 && gpu.moe_shared_on() && gpu.uses_moe_fused(experts, SharedWeights { gate: sg, up: su, down: sd }, x.d);
        // A routing left to this launch (route_op) is computed in it; any other MoE runs the
        // route kernel first.
        let route_in = self
            .routes
            .pending(routing)
            .filter(|l| fused && l.d == m.n_expert && arena.check(OP, *l).is_ok() && gpu.moe_fused_routes(m.n_expert, routing.k));
        if route_in.is_none() {
            super::routing::settle_route(gpu, arena, &mut self.routes, dev, OP, routing)?;
        }
        // The output, then scratch: the routed experts' hidden rows, the shared expert's gate,
        // up and down outputs (consecutive, after the output).
        let out = arena.alloc(gpu, OP, n, d_out)?;
        // The grouped prompt path's scratch (weighted expert outputs and its plan); other
        // batches do not read it and get one element, so the handles stay the same.
        let grouped = if gpu.moe_grouped(n, m.n_expert, prec) { moe_scratch_len(n, routing.k, m.n_expert, d_out) } else { 1 };
        // h: the routed pairs' hidden rows, then room for the shared expert's (the int8 path
        // runs it in the same kernels).
        for (rows, width) in [(n, routing.k * m.n_ff + n_ffs), (n, n_ffs), (n, n_ffs), (n, d_out), (1, grouped)] {
            arena.alloc(gpu, OP, rows, width)?;
        }
        let parts = if fused { Some(arena.alloc(gpu, OP, routing.k + 1, d_out)?) } else { None };
        let (rb, _) = self.routes.get_any(OP, routing)?;
        let (ins, mut outs) = arena.split(out.id);
        let [ob, hb, gb, ub, db, sb, rest @ ..] = &mut outs[..] else { unreachable!("six buffers were just allocated") };
        let (xb, gsb) = (&ins[x.id as usize], &ins[shared_gate.id as usize]);
        let mut run = || -> crate::Result<()> {
            let routed = MoeRouting { ids: &rb.ids, weights: &rb.weights, k: routing.k };
            if let [pb] = rest {
                let shared = MoeSharedQ8 { gate: sg, up: su, down: sd, gate_logit: gsb };
                return gpu.moe_fused_q8(experts, shared, xb, routed, route_in.map(|l| &ins[l.id as usize]), hb, pb, held);
            }
            if int8 {
                // One token on int8 activations: x quantised once for the shared expert's gate
                // and up and the routed experts' (which then quantise their h over it).
                if !held {
                    gpu.quantize_q8(xb, x.d)?;
                }
                let shared = MoeSharedQ8 { gate: sg, up: su, down: sd, gate_logit: gsb };
                if gpu.moe_shared_on() && shared.fits(experts, x.d) {
                    // The shared expert in the routed experts' kernels: three launches in all.
                    return gpu.moe_q8(experts, Some(shared), xb, n, routed, hb, ob, true);
                }
                if sg.ty == su.ty {
                    gpu.gemv_q8_quantized(&[sg.all(), su.all()], x.d, &mut [&mut *gb, &mut *ub])?;
                } else {
                    gpu.gemv_q8_quantized(&[sg.all()], x.d, &mut [&mut *gb])?;
                    gpu.gemv_q8_quantized(&[su.all()], x.d, &mut [&mut *ub])?;
                }
                gpu.moe_q8(experts, None, xb, n, routed, hb, ob, true)?;
            } else {
                gpu.moe_prec(experts, xb, n, routed, hb, sb, ob, prec)?;
                gpu.matmul_prec(sg.all(), xb, n, gb, prec)?;
                gpu.matmul_prec(su.all(), xb, n, ub, prec)?;
            }
            gpu.gate(ub, gb, n * n_ffs, Act::Silu)?;
            gpu.matmul_prec(sd.all(), ub, n, db, prec)?;
            gpu.moe_shared_add(ob, db, gsb, n, d_out)
        };
        run().map_err(cuda(OP, dev))?;
        if route_in.is_some() {
            self.routes.clear_pending(); // the launch wrote its ids and weights
        }
        if let Some(p) = parts {
            self.arena.set_pending(Parts { out: out.id, parts: p.id, n: routing.k + 1, len: n * d_out });
        }
        Ok(out)
    }

    /// The MoE of a prompt batch with every expert it routes to on the GPU: `touched` (the
    /// experts the routing names, each once) go into the stream scratch, those not resident
    /// from host memory in one staged gather, the resident ones by device copies; then the
    /// layer's MoE runs on the scratch. What an expert tier does for a batch whose misses cost
    /// more on the CPU than their upload. Synchronous until the experts are up.
    pub fn moe_streamed(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor, touched: &[u16]) -> OpResult<Tensor> {
        const OP: &str = "moe_streamed";
        let dev = self.dev;
        let fail = |e: crate::Error| OpError::new(OP, dev, format!("{layer}"), e.to_string());
        let m = *self.weights.reg.moe(OP, layer)?;
        let set = self.weights.reg.weights(OP)?.clone();
        let (gate, up) = self.weights.gate_up(OP, m.gate_up)?;
        let down = self.weights.matrix(OP, m.down)?.1;
        let d_out = set.info(m.down).map_or(0, |i| i.rows_per_mat());
        let no_pool = Vec::new();
        let resident = self.weights.pools.get(layer.index()).and_then(Option::as_ref).map_or(&no_pool, |p| &p.slot_of);
        let slot_of = |e: u16| resident.get(e as usize).copied().unwrap_or(if resident.is_empty() { e as u32 } else { MOE_MISS });
        if touched.iter().any(|&e| e as usize >= m.n_expert) {
            return Err(OpError::new(OP, dev, format!("{layer}"), format!("an expert past {}", m.n_expert)));
        }
        // Slots: the experts to upload first (one contiguous gather per tensor), then the
        // resident ones.
        let mut order: Vec<u16> = touched.iter().copied().filter(|&e| slot_of(e) == MOE_MISS).collect();
        let n_up = order.len();
        order.extend(touched.iter().copied().filter(|&e| slot_of(e) != MOE_MISS));
        let n = order.len();
        let (gb, db) = (n * m.n_ff * gate.row_bytes, n * d_out * down.row_bytes);
        // The scratch, grown to this layer's need (the old buffers go first).
        let st = match self.stream.take() {
            Some(st) if st.gate.capacity() >= gb && st.down.capacity() >= db && st.slot_of.len() >= m.n_expert => st,
            old => {
                drop(old);
                let gpu = &self.gpu;
                let (cg, cd) = (gb.max(1), db.max(1));
                StreamScratch {
                    gate: DeviceWeight::scratch(gpu, cg).map_err(fail)?,
                    up: DeviceWeight::scratch(gpu, cg).map_err(fail)?,
                    down: DeviceWeight::scratch(gpu, cd).map_err(fail)?,
                    slot_of: gpu.alloc(m.n_expert).map_err(fail)?,
                    n_slots: 0,
                }
            }
        };
        let mut st = st;
        let gpu = &self.gpu;
        let mut fill = || -> crate::Result<()> {
            st.gate.reshape(gate.ty, gate.k, n * m.n_ff)?;
            st.up.reshape(up.ty, up.k, n * m.n_ff)?;
            st.down.reshape(down.ty, down.k, n * d_out)?;
            let mut parts: [Vec<&[u8]>; 3] = Default::default();
            for &e in &order[..n_up] {
                let v = set.expert(layer, ExpertId(e)).ok_or_else(|| crate::error::shape(OP, format!("expert {e}")))?;
                parts[0].push(v.gate.data);
                parts[1].push(v.up.data);
                parts[2].push(v.down.data);
            }
            st.gate.write_rows_parts(gpu, 0, &parts[0])?;
            st.up.write_rows_parts(gpu, 0, &parts[1])?;
            st.down.write_rows_parts(gpu, 0, &parts[2])?;
            for (j, &e) in order.iter().enumerate().skip(n_up) {
                let s = slot_of(e) as usize;
                st.gate.copy_rows_from(gpu, j * m.n_ff, gate, s * m.n_ff, m.n_ff)?;
                st.up.copy_rows_from(gpu, j * m.n_ff, up, s * m.n_ff, m.n_ff)?;
                st.down.copy_rows_from(gpu, j * d_out, down, s * d_out, d_out)?;
            }
            let mut table = vec![MOE_MISS; m.n_expert];
            for (j, &e) in order.iter().enumerate() {
                table[e as usize] = j as u32;
            }
            gpu.write(&mut st.slot_of, &table)
        };
        let filled = fill();
        st.n_slots = n;
        self.stream = Some(st);
        filled.map_err(fail)?;
        self.moe_on(layer, x, routing, shared_gate, true)
    }

    /// Seconds a staged gather-upload of `parts` takes once and `n` times over (one call
    /// each, after a warm-up): what an expert tier's cost model is measured with.
    pub fn time_upload(&self, parts: &[&[u8]], n: usize) -> crate::Result<(f64, f64)> {
        let one: usize = parts.iter().map(|p| p.len()).sum();
        let many: Vec<&[u8]> = (0..n.max(1)).flat_map(|_| parts.iter().copied()).collect();
        let mut buf = self.gpu.alloc::<u8>(one * n.max(1))?;
        let mut time = |ps: &[&[u8]]| -> crate::Result<f64> {
            let t0 = std::time::Instant::now();
            self.gpu.write_parts(&mut buf, 0, ps)?;
            Ok(t0.elapsed().as_secs_f64())
        };
        time(&many)?;
        Ok((time(parts)?, time(&many)?))
    }

    /// Gives the stream scratch's memory back (it is made again on the next streamed batch).
    pub fn release_stream_scratch(&mut self) {
        self.stream = None;
    }
}
