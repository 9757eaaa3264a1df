// tcpxd block-transfer kernels: the sender's gather of scattered blocks into a contiguous wire
// chunk (a staging slot registered with the plugin), and the receiver's scatter of a received
// chunk's fragments into its blocks.
//
// Compiled by nvcc at build time or by NVRTC at start-up (no headers), loaded with the other
// kernels (src/gpu/module.rs). One launch covers up to BLOCK_TASKS chunks:
// blockIdx.y picks the chunk, and its warps stride over the chunk's work (4 KiB units of the
// chunk for the gather, fragments for the scatter), one item per warp at a time.
//
// Each chunk's table lists, in wire order, the pieces of this side's buffer the chunk covers
// (`BlockSeg`, 16 bytes: engine::blocks::Segment): `len` bytes at byte `off` of the buffer, at
// byte `wire` of the chunk. The tables travel in the launch's parameters (the `_inline_` kernels)
// or in a device arena (src/unpack/block_batch.rs); nothing is allocated per chunk. Each thread block first stages the table in shared memory (up
// to SMEM_SEGS pieces; longer tables are read in place); a warp finds the piece that holds a wire
// offset by binary search over `wire`. Layouts must match src/gpu/blocks.rs (`GatherTask`, `ScatterTask`).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define BLOCK_TASKS 16
#define BLOCK_WARPS 8
// The gather's unit of work per warp: this many bytes of the chunk (a piece may span units and a
// unit pieces).
#define GATHER_UNIT 4096u
// Pieces of a chunk's table a thread block stages in shared memory (16 bytes each: 4 KiB).
#define SMEM_SEGS 256u

struct __align__(16) BlockSeg {
    u64 off;
    u32 wire;
    u32 len;
};

// The plugin's loadMeta: `len` bytes at `src_off` of the bounce buffer belong at `dst_off` of the
// receive (for a block chunk: its wire offset).
struct __align__(16) LoadMeta {
    u32 src_off;
    u32 len;
    u64 dst_off;
};

// One chunk to gather (48 bytes).
struct __align__(16) GatherTask {
    u64 segs;     // device address of BlockSeg[nsegs] (device memory or host-mapped)
    u64 src;      // device address of the source buffer's byte 0
    u64 src_len;  // bytes readable from `src`
    u64 dst;      // the staging slot: `bytes` bytes are written from here
    u32 nsegs;
    u32 bytes;    // the chunk's length
    u64 pad;
};

// One received chunk to scatter (64 bytes).
struct __align__(16) ScatterTask {
    u64 frags;       // device address of LoadMeta[count]: the host-mapped ring, or a device copy
    u64 bounce;      // device address of the bounce buffer
    u64 bounce_len;  // bytes readable from `bounce`
    u64 segs;        // device address of BlockSeg[nsegs]
    u64 dst;         // device address of the destination buffer's byte 0
    u64 dst_len;     // bytes writable from `dst`
    u32 count;       // fragments
    u32 nsegs;
    u32 bytes;       // the chunk's length (every fragment lies inside it)
    u32 pad;
};

template <typename T, int N>
struct Tasks {
    T t[N];
};

// How a batch's last launch reports the batch done without a CUDA event (32 bytes;
// gpu::blocks::BlockSignal): when `word` is not 0, every thread block of the grid counts itself
// on the device u32 at `counter` once its copies are done, and the last one resets the counter
// and stores `seq` into the host-mapped u64 at `word` (a release at system scope, after a system
// fence: every block's writes, and the error word, are visible before the number). The host
// then sees the batch done with one load of host memory, no driver call. Grids on the batcher's
// stream run one after another (plain launches), so one counter serves every batch.
struct BlockSignal {
    u64 counter;
    u64 word;
    u64 seq;
    u64 pad;
};

// Each block orders its writes (the barrier makes them its thread 0's to order) before its count
// at system scope; the last block, which observed every count, stores the number. The signal
// costs ~2.5 µs a launch on an H200 (tcpxd-unpack-bench's scatter-kernel rows with and without
// it), the same with GPU-scope fences in the blocks; it saves the poller an event record per
// batch and a driver call per poll.
__device__ __forceinline__ void signal_done(const BlockSignal& s) {
    if (s.word == 0) return;  // the same for every block of the grid
    __syncthreads();          // every warp of this block finished its copies
    if (threadIdx.x == 0) {
        __threadfence_system();
        const u32 blocks = gridDim.x * gridDim.y;
        if (atomicAdd((u32*)s.counter, 1u) == blocks - 1) {
            *(volatile u32*)s.counter = 0u;
            __threadfence_system();
            asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(s.word), "l"(s.seq) : "memory");
        }
    }
}

__device__ __forceinline__ LoadMeta load_meta(const LoadMeta* p) {
    u64 a, b;
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p));
    LoadMeta m;
    m.src_off = (u32)a;
    m.len = (u32)(a >> 32);
    m.dst_off = b;
    return m;
}

__device__ __forceinline__ BlockSeg load_seg(const BlockSeg* p) {
    u64 a, b;
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p));
    BlockSeg s;
    s.off = a;
    s.wire = (u32)b;
    s.len = (u32)(b >> 32);
    return s;
}

// Warp-cooperative copy of `len` bytes where `src` and `dst` agree modulo sizeof(T): byte head
// until aligned, then T-wide words (4 in flight per lane), then a byte tail.
template <typename T>
__device__ __forceinline__ void copy_words(const u8* src, u8* dst, u32 len, u32 lane) {
    const u32 w = sizeof(T);
    u32 head = (u32)((w - ((u64)src & (w - 1))) & (w - 1));
    if (head > len) head = len;
    if (lane < head) dst[lane] = src[lane];
    src += head;
    dst += head;
    len -= head;
    const u32 n = len / w;
    const T* s = (const T*)src;
    T* d = (T*)dst;
    u32 i = lane;
    for (; i + 96 < n; i += 128) {
        T a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
        d[i] = a;
        d[i + 32] = b;
        d[i + 64] = c;
        d[i + 96] = e;
    }
    for (; i < n; i += 32) d[i] = s[i];
    const u32 done = n * w;
    if (lane < len - done) dst[done + lane] = src[done + lane];
}

__device__ __forceinline__ void copy_piece(const u8* src, u8* dst, u32 len, u32 lane) {
    const u64 phase = (u64)src ^ (u64)dst;
    if ((phase & 15) == 0) {
        copy_words<uint4>(src, dst, len, lane);
    } else if ((phase & 7) == 0) {
        copy_words<u64>(src, dst, len, lane);
    } else if ((phase & 3) == 0) {
        copy_words<u32>(src, dst, len, lane);
    } else if ((phase & 1) == 0) {
        copy_words<u16>(src, dst, len, lane);
    } else {
        for (u32 i = lane; i < len; i += 32) dst[i] = src[i];
    }
}

// A chunk's table as a thread block reads it: staged in shared memory when it has at most
// SMEM_SEGS pieces (the whole block reads it once, in parallel), else read in place. The table
// lies in device memory (the batch's arena, read with volatile global loads) or, for the inline
// kernels, in the launch's parameter block (`param`: plain loads through the parameter's address).
struct Table {
    const BlockSeg* global;
    const BlockSeg* shared;
    u32 n;
    bool staged;
    bool param;
};

__device__ __forceinline__ BlockSeg read_seg(const BlockSeg* p, bool param) {
    return param ? *p : load_seg(p);
}

__device__ __forceinline__ Table stage_table(const BlockSeg* segs, u32 nsegs, BlockSeg* s_segs, bool param) {
    Table tb;
    tb.global = segs;
    tb.shared = s_segs;
    tb.n = nsegs;
    tb.staged = nsegs <= SMEM_SEGS;
    tb.param = param;
    if (tb.staged) {
        for (u32 i = threadIdx.x; i < nsegs; i += blockDim.x) s_segs[i] = read_seg(segs + i, param);
    }
    // Every thread of the block reaches this (called once, before any work loop).
    __syncthreads();
    return tb;
}

__device__ __forceinline__ BlockSeg seg_at(const Table& tb, u32 i) {
    return tb.staged ? tb.shared[i] : read_seg(tb.global + i, tb.param);
}

// The last piece whose `wire` is <= w (pieces are in wire order, the first at wire 0).
__device__ __forceinline__ u32 find_seg(const Table& tb, u32 w) {
    u32 lo = 0, hi = tb.n;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (seg_at(tb, mid).wire <= w) lo = mid; else hi = mid;
    }
    return lo;
}

__device__ __forceinline__ void report(u32* err, u32 task, u32 item) {
    *(volatile u32*)err = 1u + ((task << 12) | (item & 0xfff));
}

// Gather: warp u copies wire bytes [u * GATHER_UNIT, min(bytes, (u + 1) * GATHER_UNIT)) of the
// chunk from the pieces that hold them. A piece reaching past the source or the chunk is skipped
// and reported in `err` (1 + (task << 12 | unit)); the host validated the tables, so this is a
// guard only.
__device__ __forceinline__ void gather_body(const GatherTask& t, const BlockSeg* segs, bool param, u32* err) {
    const u32 lane = threadIdx.x & 31;
    const u32 units = (t.bytes + GATHER_UNIT - 1) / GATHER_UNIT;
    __shared__ BlockSeg s_segs[SMEM_SEGS];
    const Table tb = stage_table(segs, t.nsegs, s_segs, param);
    for (u32 u = blockIdx.x * BLOCK_WARPS + (threadIdx.x >> 5); u < units; u += gridDim.x * BLOCK_WARPS) {
        u32 w = u * GATHER_UNIT;
        const u32 end = min(t.bytes, w + GATHER_UNIT);
        if (t.nsegs == 0) {
            if (lane == 0) report(err, blockIdx.y, u);
            continue;
        }
        u32 i = find_seg(tb, w);
        while (w < end && i < t.nsegs) {
            const BlockSeg s = seg_at(tb, i);
            const u64 seg_end = (u64)s.wire + s.len;
            if (s.wire > w || seg_end <= w || s.off + s.len > t.src_len || seg_end > t.bytes) {
                if (lane == 0) report(err, blockIdx.y, u);
                break;
            }
            const u32 stop = seg_end < end ? (u32)seg_end : end;
            copy_piece((const u8*)(t.src + s.off + (w - s.wire)), (u8*)(t.dst + w), stop - w, lane);
            w = stop;
            i++;
        }
        if (w < end && lane == 0) report(err, blockIdx.y, u);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_WARPS * 32)
    tcpxd_gather_blocks(const __grid_constant__ Tasks<GatherTask, BLOCK_TASKS> tasks, u32* err,
                        const BlockSignal done) {
    const GatherTask& t = tasks.t[blockIdx.y];
    gather_body(t, (const BlockSeg*)t.segs, false, err);
    signal_done(done);
}

// Copies a batch's piece tables (`n` 16-byte words) from the pinned arena the poller filled into
// the device arena the block kernels then read: one read across PCIe per table, done by the SMs
// (on a receiving GPU the copy engines are busy with the plugin's own copies, and a small copy
// queued behind them waits for hundreds of µs).
extern "C" __global__ void tcpxd_copy_tables(const uint4* src, uint4* dst, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}

// Scatter: warp f takes fragment f of the chunk (`len` bytes at `src_off` of the bounce buffer,
// wire offset `dst_off`) and copies it into the pieces of the destination that hold those wire
// bytes. A fragment outside the chunk or the bounce buffer, or a piece outside the destination,
// is skipped and reported in `err` (1 + (task << 12 | fragment)).
//
// The fragment list is the plugin's ring, read across PCIe: each round the block's first
// BLOCK_WARPS threads fetch the round's entries together (one coalesced 128-byte read, as the
// unpack kernel does) into shared memory. A warp fetching its own entry cost ~10 µs more per
// launch on an H200 (tcpxd-unpack-bench's scatter-kernel rows: 128 separate 16-byte reads). The
// first round's fetch is issued before the table is staged, so the two overlap.
__device__ __forceinline__ void scatter_body(const ScatterTask& t, const BlockSeg* segs, bool param, u32* err) {
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const LoadMeta* frags = (const LoadMeta*)t.frags;
    const u32 stride = gridDim.x * BLOCK_WARPS;
    __shared__ LoadMeta s_frags[BLOCK_WARPS];
    u32 base = blockIdx.x * BLOCK_WARPS;
    if (threadIdx.x < BLOCK_WARPS && base + threadIdx.x < t.count) s_frags[threadIdx.x] = load_meta(frags + base + threadIdx.x);
    __shared__ BlockSeg s_segs[SMEM_SEGS];
    const Table tb = stage_table(segs, t.nsegs, s_segs, param);  // (its __syncthreads publishes s_frags)
    // `base` is the same for every thread of the block: the loop's barriers are reached by all.
    while (base < t.count) {
        const u32 f = base + warp;
        if (f < t.count) {
            const LoadMeta m = s_frags[warp];
            const bool ok = !(m.dst_off > t.bytes || (u64)m.len > t.bytes - m.dst_off ||
                              (u64)m.src_off + m.len > t.bounce_len || t.nsegs == 0);
            if (m.len != 0 && !ok) {
                if (lane == 0) report(err, blockIdx.y, f);
            } else if (m.len != 0) {
                u32 w = (u32)m.dst_off;
                const u32 end = w + m.len;
                u32 i = find_seg(tb, w);
                while (w < end && i < t.nsegs) {
                    const BlockSeg s = seg_at(tb, i);
                    const u64 seg_end = (u64)s.wire + s.len;
                    if (s.wire > w || seg_end <= w || s.off > t.dst_len || (u64)s.len > t.dst_len - s.off) {
                        if (lane == 0) report(err, blockIdx.y, f);
                        break;
                    }
                    const u32 stop = seg_end < end ? (u32)seg_end : end;
                    copy_piece((const u8*)(t.bounce + m.src_off + (w - m.dst_off)), (u8*)(t.dst + s.off + (w - s.wire)),
                               stop - w, lane);
                    w = stop;
                    i++;
                }
                if (w < end && lane == 0) report(err, blockIdx.y, f);
            }
        }
        base += stride;
        if (base >= t.count) break;
        __syncthreads();  // every warp is done with this round's entries
        if (threadIdx.x < BLOCK_WARPS && base + threadIdx.x < t.count) s_frags[threadIdx.x] = load_meta(frags + base + threadIdx.x);
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_WARPS * 32)
    tcpxd_scatter_blocks(const __grid_constant__ Tasks<ScatterTask, BLOCK_TASKS> tasks, u32* err,
                         const BlockSignal done) {
    const ScatterTask& t = tasks.t[blockIdx.y];
    scatter_body(t, (const BlockSeg*)t.segs, false, err);
    signal_done(done);
}

// ---- tables inline in the kernel parameters ---------------------------------------------------
// A batch whose tables are small travels whole in the launch's parameter block (CUDA 12.1+ large
// parameters): no table copy, no second launch before the kernel. Each task's `segs` is then the
// index of its first piece in `segs` below, not an address. Two sizes: 256 pieces (5 KiB with a
// scatter batch's tasks) and 576 (10 KiB: 16 chunks of 16 KiB blocks); larger tables go through
// the device arena (a 31 KiB parameter block was measured slower than an upload, docs/GPU.md).
template <typename T, int CAP>
struct InlineTables {
    Tasks<T, BLOCK_TASKS> tasks;
    u64 err;  // device address of the batch's error word
    u64 pad;
    BlockSignal done;
    BlockSeg segs[CAP];
};

#define INLINE_KERNELS(CAP)                                                                          \
    extern "C" __global__ void __launch_bounds__(BLOCK_WARPS * 32)                                  \
        tcpxd_gather_blocks_inline_##CAP(const __grid_constant__ InlineTables<GatherTask, CAP> p) { \
        const GatherTask& t = p.tasks.t[blockIdx.y];                                                 \
        gather_body(t, p.segs + t.segs, true, (u32*)p.err);                                          \
        signal_done(p.done);                                                                         \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(BLOCK_WARPS * 32)                                  \
        tcpxd_scatter_blocks_inline_##CAP(const __grid_constant__ InlineTables<ScatterTask, CAP> p) { \
        const ScatterTask& t = p.tasks.t[blockIdx.y];                                                \
        scatter_body(t, p.segs + t.segs, true, (u32*)p.err);                                         \
        signal_done(p.done);                                                                         \
    }

INLINE_KERNELS(256)
INLINE_KERNELS(576)
