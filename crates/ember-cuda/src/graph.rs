//! Launch recording and CUDA graph replay.
//!
//! While a [`crate::Gpu`] records, every kernel launch is stored (function, grid, block, shared
//! memory, the parameter struct's bytes) instead of sent; the next call that touches the stream
//! flushes the list first, so the stream sees the same work in the same order. A flush replays
//! the list as one CUDA graph: a linear chain of kernel nodes, built with the driver's graph API
//! and kept in a small LRU cache keyed by the sequence of functions. On a hit only the nodes whose
//! grid, block, shared memory or parameters changed are updated in the executable graph
//! (`cuGraphExecKernelNodeSetParams`, which affects later launches only), then the graph goes on
//! the stream with one `cuGraphLaunch`. A sequence seen for the first time, or shorter than
//! [`MIN_NODES`], is launched kernel by kernel: a prompt of a size never seen costs no graph
//! build.
//!
//! On sm_90+ the chain's edges are programmatic (`EMBER_CUDA_PDL=0` turns that off): a kernel's
//! blocks may launch while the kernel ahead of it finishes, and each kernel's first act
//! (`pdl_enter` in kernels/prelude.cuh) waits for the one ahead to finish and its writes to be
//! visible. That hides the launch latency between two kernels, which is most of what a small
//! kernel costs in a decode step of ~1,000 of them.
//!
//! The design decision a reader would question: graphs are built from the recorded list with
//! the driver API rather than by stream capture, so a step pays no capture, and a hit is a
//! byte comparison of the parameters plus a few node updates instead of a re-capture and an
//! instantiate (decode at growing depth changes only the attention launches' grid and params).

use std::ffi::c_void;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{CudaStream, result, sys};

use crate::error::{Result, drv};

/// Shortest recorded list that is replayed as a graph: a graph launch costs the host about as
/// much as a few kernel launches, so a shorter list goes out kernel by kernel.
pub const MIN_NODES: usize = 4;
/// Executable graphs kept (least recently used goes first). A decode step of one batch shape is
/// one graph; prompt steps, batched steps and the steps that split at a KV page boundary add a
/// few more.
pub const MAX_GRAPHS: usize = 64;
/// Sequences remembered as seen once (a second sighting builds the graph).
const MAX_SEEN: usize = 128;
/// Launches of a step's first recorded list (see [`crate::Gpu`]'s `chunk`).
pub const FIRST_CHUNK: usize = 32;
/// The default most launches per recorded list. Measured on the H200 (35B-A3B decode, ~1,000
/// launches a step, 2026-12-04, one tg128 run each): caps of 64 / 128 / 256 / 512 134.4 /
/// 135.2 / 131.1 / 137.0 t/s; one list per step (no chunks) 131.7 in an earlier call's tg64.
pub const CHUNK: usize = 512;

/// One recorded launch; its parameter struct is `words[at..at + n_words]` of the recorder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Launch {
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    at: usize,
    n_words: usize,
}

/// A node's launch shape and parameters as the executable graph holds them now.
struct NodeState {
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    words: Vec<u64>,
}

/// An instantiated linear graph of kernel nodes.
struct Graph {
    hash: u64,
    funcs: Vec<sys::CUfunction>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    nodes: Vec<sys::CUgraphNode>,
    state: Vec<NodeState>,
    last_used: u64,
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: `exec` (when instantiated) and `graph` were made by this Graph and are
        // destroyed once, here; launches already on the stream complete first (the driver
        // defers releasing an executable graph that is still running).
        unsafe {
            if !self.exec.is_null() {
                let _ = result::graph::exec_destroy(self.exec);
            }
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// How flushes went, for tests and profiles.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Flushes that went out as a graph launch.
    pub graph_launches: u64,
    /// Graphs built (each on the second sighting of its sequence).
    pub builds: u64,
    /// Nodes updated in place before a graph launch.
    pub node_updates: u64,
    /// Kernels launched one by one at a flush (first sightings, short lists).
    pub eager_kernels: u64,
    /// Graph builds or updates the driver refused (the list then went out kernel by kernel).
    pub failures: u64,
}

/// What is recorded and the graph cache.
#[derive(Default)]
pub(crate) struct Recorder {
    launches: Vec<Launch>,
    /// Every recorded parameter struct, each from a word boundary (8-byte aligned).
    words: Vec<u64>,
    /// FNV-1a over the recorded functions.
    hash: u64,
    graphs: Vec<Graph>,
    seen: Vec<u64>,
    /// Launches that fill the list being recorded (doubles at each flush of a step).
    limit: usize,
    /// Build a list seen for the first time as a graph at once ([`Recorder::restart_chunks`]).
    build_now: bool,
    tick: u64,
    /// Whether graphs chain their kernels with programmatic edges (see the module doc).
    programmatic: bool,
    pub stats: GraphStats,
}

// SAFETY: the raw handles inside (functions, graphs, nodes) are driver objects usable from any
// thread of the process; graph objects need their calls serialised, and the Recorder lives
// only under the Gpu's mutex.
unsafe impl Send for Recorder {}

/// Drop of buffers named by recorded launches: shared by the [`crate::Gpu`] and every buffer.
#[derive(Default)]
pub(crate) struct Pending {
    /// Set while launches are recorded and not on the stream yet.
    pub any: AtomicBool,
    /// Device buffers dropped while `any` was set: freed (stream-ordered) after the flush that
    /// puts the launches naming them on the stream.
    pub graveyard: Mutex<Vec<Box<dyn Send>>>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn params_of(words: &mut [u64]) -> [*mut c_void; 1] {
    [words.as_mut_ptr().cast::<c_void>()]
}

/// The driver's node parameters for `l` with its parameter struct at `*arg`.
fn node_params(l: &Launch, arg: &mut [*mut c_void; 1]) -> sys::CUDA_KERNEL_NODE_PARAMS {
    sys::CUDA_KERNEL_NODE_PARAMS {
        func: l.f,
        gridDimX: l.grid.0,
        gridDimY: l.grid.1,
        gridDimZ: l.grid.2,
        blockDimX: l.block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: l.smem,
        kernelParams: arg.as_mut_ptr(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    }
}

fn check(op: &'static str, rc: sys::CUresult) -> Result<()> {
    rc.result().map_err(drv(op))
}

impl Recorder {
    /// Chains the kernels of graphs built from now on with programmatic edges (sm_90+ only:
    /// the kernels' `pdl_enter` needs `griddepcontrol`).
    pub fn set_programmatic(&mut self, on: bool) {
        self.programmatic = on;
    }

    /// The next list is a step's first: it fills at `first` launches, or [`FIRST_CHUNK`]'s.
    /// With `build_now`, this step's lists seen for the first time are built as graphs at once
    /// rather than launched kernel by kernel (a step queued behind a wait for the host: its
    /// ~500 kernels one by one could fill the stream's queue of ~1,000 launches, and a host
    /// blocked on a full queue cannot end the wait).
    pub fn restart_chunks(&mut self, first: Option<usize>, build_now: bool) {
        self.limit = first.unwrap_or(0);
        self.build_now = build_now;
    }

    /// Stores one launch; `params` are the bytes of its parameter struct. True when the list
    /// is full (the first list since [`Recorder::restart_chunks`] at [`FIRST_CHUNK`] launches,
    /// each next at twice the last, at most `chunk`): time to flush.
    pub fn record(&mut self, f: sys::CUfunction, grid: (u32, u32, u32), block: u32, smem: u32, params: &[u8], chunk: usize) -> bool {
        if self.launches.is_empty() {
            self.hash = FNV_OFFSET;
            self.words.clear();
        }
        let at = self.words.len();
        let n_words = params.len().div_ceil(8);
        self.words.resize(at + n_words, 0);
        for (w, chunk) in self.words[at..].iter_mut().zip(params.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *w = u64::from_ne_bytes(b);
        }
        self.hash = (self.hash ^ f as usize as u64).wrapping_mul(FNV_PRIME);
        self.launches.push(Launch { f, grid, block, smem, at, n_words });
        if self.limit == 0 {
            self.limit = first_chunk().min(chunk);
        }
        self.launches.len() >= self.limit.min(chunk)
    }

    /// Drops the recorded launches unsent.
    pub fn discard(&mut self) {
        self.launches.clear();
    }

    /// Drops every recorded launch and graph (the GPU is going away).
    pub fn clear(&mut self) {
        self.launches.clear();
        self.graphs.clear();
    }

    /// Puts the recorded launches on `stream` (a graph when one pays) and empties the list.
    ///
    /// # Safety
    /// Every recorded launch must satisfy [`crate::Gpu::launch`]'s contract now: its functions'
    /// modules loaded, every device address in its parameters inside a live buffer.
    pub unsafe fn flush(&mut self, stream: &CudaStream) -> Result<()> {
        if self.launches.is_empty() {
            return Ok(());
        }
        let launches = std::mem::take(&mut self.launches);
        self.limit = self.limit.saturating_mul(2);
        // SAFETY: the caller's contract, passed on.
        let r = unsafe { self.replay(&launches, stream) };
        self.launches = launches;
        self.launches.clear();
        r
    }

    /// # Safety
    /// As [`Recorder::flush`].
    unsafe fn replay(&mut self, launches: &[Launch], stream: &CudaStream) -> Result<()> {
        self.tick += 1;
        let hash = self.hash;
        let same = |g: &Graph| g.hash == hash && g.funcs.len() == launches.len() && g.funcs.iter().zip(launches).all(|(f, l)| *f == l.f);
        if let Some(i) = self.graphs.iter().position(same) {
            // SAFETY: the caller's contract, passed on.
            match unsafe { self.update(i, launches) } {
                Ok(()) => {
                    let g = &mut self.graphs[i];
                    g.last_used = self.tick;
                    // SAFETY: the graph's nodes now hold exactly the recorded launches.
                    unsafe { result::graph::launch(g.exec, stream.cu_stream()) }.map_err(drv("cuGraphLaunch"))?;
                    self.stats.graph_launches += 1;
                    return Ok(());
                }
                Err(_) => {
                    // The node state is unknown now: the graph goes, the list goes out eagerly.
                    self.stats.failures += 1;
                    self.graphs.swap_remove(i);
                }
            }
        } else if launches.len() >= MIN_NODES {
            let seen = self.seen.iter().position(|h| *h == hash);
            if seen.is_some() || self.build_now {
                if let Some(j) = seen {
                    self.seen.remove(j);
                }
                // SAFETY: the caller's contract, passed on.
                match unsafe { self.build(hash, launches) } {
                    Ok(g) => {
                        // SAFETY: the graph holds exactly the recorded launches.
                        unsafe { result::graph::launch(g.exec, stream.cu_stream()) }.map_err(drv("cuGraphLaunch"))?;
                        if self.graphs.len() >= MAX_GRAPHS
                            && let Some(old) = (0..self.graphs.len()).min_by_key(|&k| self.graphs[k].last_used)
                        {
                            self.graphs.swap_remove(old);
                        }
                        self.graphs.push(g);
                        self.stats.builds += 1;
                        self.stats.graph_launches += 1;
                        return Ok(());
                    }
                    Err(_) => self.stats.failures += 1,
                }
            } else {
                if self.seen.len() >= MAX_SEEN {
                    self.seen.remove(0);
                }
                self.seen.push(hash);
            }
        }
        for l in launches {
            let mut arg = params_of(&mut self.words[l.at..l.at + l.n_words]);
            // SAFETY: the caller's contract; `arg` points at the recorded parameter struct,
            // which the driver copies before this call returns.
            unsafe { result::launch_kernel(l.f, l.grid, (l.block, 1, 1), l.smem, stream.cu_stream(), &mut arg) }
                .map_err(drv("cuLaunchKernel"))?;
        }
        self.stats.eager_kernels += launches.len() as u64;
        Ok(())
    }

    /// A linear graph of `launches`, instantiated.
    ///
    /// # Safety
    /// As [`Recorder::flush`].
    unsafe fn build(&mut self, hash: u64, launches: &[Launch]) -> Result<Graph> {
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: writes one graph handle.
        check("cuGraphCreate", unsafe { sys::cuGraphCreate(&mut graph, 0) })?;
        // From here the Graph owns `graph` (its drop destroys it, and `exec` once made).
        let mut g = Graph {
            hash,
            funcs: launches.iter().map(|l| l.f).collect(),
            graph,
            exec: std::ptr::null_mut(),
            nodes: Vec::with_capacity(launches.len()),
            state: Vec::with_capacity(launches.len()),
            last_used: self.tick,
        };
        for l in launches {
            let words = &mut self.words[l.at..l.at + l.n_words];
            let mut arg = params_of(words);
            let p = node_params(l, &mut arg);
            let mut node: sys::CUgraphNode = std::ptr::null_mut();
            let prev = g.nodes.last().copied();
            let (deps, n_deps) = match &prev {
                Some(prev) if !self.programmatic => (prev as *const sys::CUgraphNode, 1),
                _ => (std::ptr::null(), 0),
            };
            // SAFETY: `p` names a loaded function and points at its parameter struct, which the
            // driver copies; `deps` is null or one node of this graph.
            check("cuGraphAddKernelNode", unsafe { sys::cuGraphAddKernelNode_v2(&mut node, g.graph, deps, n_deps, &p) })?;
            if let Some(prev) = prev.filter(|_| self.programmatic) {
                // The node may launch once every block of `prev` has passed its `pdl_enter`.
                let edge = sys::CUgraphEdgeData {
                    from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                    to_port: 0,
                    type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
                    reserved: [0; 5],
                };
                // SAFETY: `prev` and `node` are kernel nodes of this graph; one edge, one datum.
                check("cuGraphAddDependencies", unsafe { sys::cuGraphAddDependencies_v2(g.graph, &prev, &node, &edge, 1) })?;
            }
            g.nodes.push(node);
            g.state.push(NodeState { grid: l.grid, block: l.block, smem: l.smem, words: words.to_vec() });
        }
        // SAFETY: `g.graph` is a valid graph of kernel nodes.
        g.exec = unsafe { result::graph::instantiate(g.graph, sys::CUgraphInstantiate_flags(0)) }.map_err(drv("cuGraphInstantiate"))?;
        Ok(g)
    }

    /// Brings graph `i`'s nodes to `launches` (same functions), updating only what changed.
    ///
    /// # Safety
    /// As [`Recorder::flush`].
    unsafe fn update(&mut self, i: usize, launches: &[Launch]) -> Result<()> {
        let g = &mut self.graphs[i];
        for (k, l) in launches.iter().enumerate() {
            let words = &mut self.words[l.at..l.at + l.n_words];
            let s = &mut g.state[k];
            if s.grid == l.grid && s.block == l.block && s.smem == l.smem && s.words == *words {
                continue;
            }
            let mut arg = params_of(words);
            let p = node_params(l, &mut arg);
            // SAFETY: node k of this graph is a kernel node of the same function; the driver
            // copies the parameters and applies them to later launches only.
            let rc = unsafe { sys::cuGraphExecKernelNodeSetParams_v2(g.exec, g.nodes[k], &p) };
            check("cuGraphExecKernelNodeSetParams", rc)?;
            *s = NodeState { grid: l.grid, block: l.block, smem: l.smem, words: words.to_vec() };
            self.stats.node_updates += 1;
        }
        Ok(())
    }
}

/// Frees what was dropped while launches were pending (after they went on the stream).
pub(crate) fn bury(pending: &Pending) {
    let dead = std::mem::take(&mut *pending.graveyard.lock().unwrap_or_else(|e| e.into_inner()));
    drop(dead);
}

/// Whether `EMBER_CUDA_GRAPH` leaves graphs on (anything but `0`, `off` or `false`).
pub(crate) fn graphs_from_env() -> bool {
    !matches!(std::env::var("EMBER_CUDA_GRAPH").as_deref(), Ok("0" | "off" | "false"))
}

/// The first list's launches: [`FIRST_CHUNK`], or `EMBER_CUDA_GRAPH_FIRST` (for measuring how
/// soon the GPU gets a step's first kernels).
fn first_chunk() -> usize {
    static FIRST: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *FIRST.get_or_init(|| {
        std::env::var("EMBER_CUDA_GRAPH_FIRST").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or(FIRST_CHUNK)
    })
}

/// `EMBER_CUDA_GRAPH_CHUNK`: the most launches per recorded list (at least 1; default
/// [`CHUNK`]).
pub(crate) fn chunk_from_env() -> usize {
    std::env::var("EMBER_CUDA_GRAPH_CHUNK").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or(CHUNK)
}

/// Whether `EMBER_CUDA_PDL` leaves programmatic edges on (anything but `0`, `off` or `false`;
/// they are used on sm_90+ only).
pub(crate) fn programmatic_from_env() -> bool {
    !matches!(std::env::var("EMBER_CUDA_PDL").as_deref(), Ok("0" | "off" | "false"))
}

/// Reads `any` (for a buffer's drop).
pub(crate) fn is_pending(p: &Pending) -> bool {
    p.any.load(Ordering::Acquire)
}
