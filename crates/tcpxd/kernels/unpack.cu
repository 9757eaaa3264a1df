// tcpxd unpack kernel: gathers the fragments TCPX left in its bounce buffer into the destination.
//
// Compiled either by nvcc at build time (PTX embedded in the binary) or by NVRTC at start-up, so it
// includes no headers. One launch covers every task (completed receive) of a batch: blockIdx.y
// picks the task, and the task's warps stride over its fragments, one fragment per warp at a time.
//
// Layouts must match src/unpack/kernel.rs (`UnpackTask`, `TaskArray`).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// `union alignas(16) loadMeta` of the plugin ABI.
struct __align__(16) LoadMeta {
    u32 src_off;
    u32 len;
    u64 dst_off;
};

// One completed receive (48 bytes).
struct __align__(16) UnpackTask {
    u64 frags;       // device address of LoadMeta[count]: the host-mapped ring, or a device copy
    u64 bounce;      // device address of the bounce buffer
    u64 bounce_len;  // bytes readable from `bounce`
    u64 dst;         // device address of the destination's byte 0
    u64 dst_len;     // bytes writable from `dst`
    u32 count;       // fragments
    u32 format;      // how `frags` is encoded: FMT_META, FMT_PAGE32 or FMT_PACKED12
};

// List encodings. FMT_META: the plugin's 16-byte loadMeta (the ring itself). The compact ones
// are written by the host into pinned staging (fewer bytes to cross PCIe): FMT_PAGE32 is one u32
// per whole 4 KiB page, (src_off / 4096) << 12 | (dst_off / 4096); FMT_PACKED12 is three u32
// (src_off, len, dst_off) for destinations under 4 GiB.
#define FMT_META 0
#define FMT_PAGE32 1
#define FMT_PACKED12 2

// Tuning knobs (kernels/tune_unpack.cu sweeps them; the defaults are what tcpxd ships, and
// WARPS_PER_BLOCK must match UNPACK_WARPS_PER_BLOCK in src/gpu/launch.rs).
#ifndef WARPS_PER_BLOCK
#define WARPS_PER_BLOCK 8
#endif
#ifndef UNROLL
#define UNROLL 8
#endif
// 0: __ldg; 1: __ldcs (evict-first); 2: ld.global.nc with a 256-byte L2 prefetch.
#ifndef UNPACK_LOAD
#define UNPACK_LOAD 0
#endif

template <int N>
struct TaskArray {
    UnpackTask t[N];
};

// The fragment list may live in host memory the plugin rewrites between batches: read it with
// volatile (uncached, system-visible) loads so no stale line from an earlier use of the slot is
// ever seen.
__device__ __forceinline__ LoadMeta load_meta(const LoadMeta* p) {
    u64 a, b;
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p));
    LoadMeta m;
    m.src_off = (u32)a;
    m.len = (u32)(a >> 32);
    m.dst_off = b;
    return m;
}

template <typename T>
__device__ __forceinline__ T load_nc(const T* p) {
#if UNPACK_LOAD == 1
    return __ldcs(p);
#else
    return __ldg(p);
#endif
}

#if UNPACK_LOAD == 2
template <>
__device__ __forceinline__ uint4 load_nc<uint4>(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
#endif

// Source loads. A launched kernel reads the bounce buffer through the read-only cache (its lines
// cannot go stale within one launch); the persistent grid outlives many batches while the NIC
// (or the emulation) rewrites bounce pages, so it reads with ld.global.cg (L2 only, coherent).
template <bool CG, typename T>
__device__ __forceinline__ T load_src(const T* p) {
    if (CG) return __ldcg(p);
    return load_nc(p);
}

// Warp-cooperative copy of `len` bytes where `src` and `dst` agree modulo sizeof(T): byte head
// until aligned, then T-wide words (UNROLL loads in flight per lane), then a byte tail.
template <typename T, bool CG = false>
__device__ __forceinline__ void copy_words(const u8* src, u8* dst, u32 len, u32 lane) {
    const u32 w = sizeof(T);
    u32 head = (u32)((w - ((u64)src & (w - 1))) & (w - 1));
    if (head > len) head = len;
    if (lane < head) dst[lane] = load_src<CG>(src + lane);
    src += head;
    dst += head;
    len -= head;
    const u32 n = len / w;
    const T* s = (const T*)src;
    T* d = (T*)dst;
    u32 i = lane;
    for (; i + 32 * (UNROLL - 1) < n; i += 32 * UNROLL) {
        T v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) v[u] = load_src<CG>(s + i + 32 * u);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) d[i + 32 * u] = v[u];
    }
    // The rest (fewer than UNROLL rounds): all loads first, so it costs one round trip too.
    if (i < n) {
        T v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            if (i + 32 * u < n) v[u] = load_src<CG>(s + i + 32 * u);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            if (i + 32 * u < n) d[i + 32 * u] = v[u];
    }
    const u32 done = n * w;
    if (lane < len - done) dst[done + lane] = load_src<CG>(src + done + lane);
}

template <bool CG = false>
__device__ __forceinline__ void copy_fragment(const u8* src, u8* dst, u32 len, u32 lane) {
    const u64 phase = (u64)src ^ (u64)dst;
    if ((phase & 15) == 0) {
        copy_words<uint4, CG>(src, dst, len, lane);
    } else if ((phase & 7) == 0) {
        copy_words<u64, CG>(src, dst, len, lane);
    } else if ((phase & 3) == 0) {
        copy_words<u32, CG>(src, dst, len, lane);
    } else if ((phase & 1) == 0) {
        copy_words<u16, CG>(src, dst, len, lane);
    } else {
        for (u32 i = lane; i < len; i += 32) dst[i] = load_src<CG>(src + i);
    }
}

// `err` (host-mapped) receives 1 + (task << 12 | fragment) of a fragment that would read or write
// out of bounds; such fragments are skipped. The host validates first, so this is a guard only.
__device__ __forceinline__ u32 load_u32_volatile(const u32* p) {
    u32 v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Completion without a CUDA event or any cross-block traffic: every launch carries the number of
// the newest batch issued before it, and its block (0, 0) stores that number into `done` (a
// host-mapped u64 the host polls with a plain load) once the previous grids on the stream have
// completed, which is when that batch has: batch n is reported done by the first launch after
// it. The newest batch, which no launch follows yet, is seen done by the host asking the stream
// (idle means finished). value == 0: nothing to report.
//
// `sums` (host-mapped u32 per block of this launch, 0: none): each task kernel block stores the
// lengths of the entries it fetched, added up (saturated to 2^32 - 1), at blockIdx.y * gridDim.x +
// blockIdx.x, so that the host can tell, once the batch is done, whether each list adds up to
// its receive's size without reading the lists itself.
struct Signal {
    u64 done;
    u64 value;
    u64 sums;
};

// Call after the previous grid has completed (wait_for_previous_grid, or a plain launch), as early
// as possible: the host learns of the batch then. A release store at system scope: what the
// previous grids stored into host memory (error words, sums), which this thread now observes, is
// visible to the host before the number that tells it to look.
__device__ __forceinline__ void signal_previous(const Signal& s) {
    if (s.value != 0 && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(s.done), "l"(s.value) : "memory");
}

// Programmatic dependent launch (sm_90): a launch may start while the previous one on its stream
// finishes, fetch its fragment lists (a round trip over PCIe) and only then wait for the previous
// grid to complete (and its stores to be visible) before copying. Without such a launch both are
// no-ops.
__device__ __forceinline__ void allow_next_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Each round, the block's first WARPS_PER_BLOCK threads fetch the round's entries together (one
// small coalesced read, which matters when the list is read across PCIe: the ring in place, or a
// compact copy of it), then each warp copies one fragment. The first fetch happens before the
// wait for the previous grid, so with overlapping launches it leaves the critical path.
// Returns the lengths of the entries this thread fetched (threads 0..WARPS_PER_BLOCK-1), added up.
// Signals (signal_previous) right after its wait for the previous grid; `waited` says whether it
// got there (a block with no round does not).
__device__ __forceinline__ u64 unpack_rounds(const UnpackTask& t, u32* err, const Signal& sig, bool& waited) {
    __shared__ u32 s_src[WARPS_PER_BLOCK];
    __shared__ u32 s_len[WARPS_PER_BLOCK];
    __shared__ u64 s_dst[WARPS_PER_BLOCK];
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32* list = (const u32*)t.frags;
    const u32 format = t.format;
    u64 fetched = 0;
    for (u32 base = blockIdx.x * WARPS_PER_BLOCK; base < t.count; base += gridDim.x * WARPS_PER_BLOCK) {
        const u32 i = base + threadIdx.x;
        if (threadIdx.x < WARPS_PER_BLOCK && i < t.count) {
            if (format == FMT_PAGE32) {
                const u32 e = load_u32_volatile(list + i);
                s_src[threadIdx.x] = (e >> 12) << 12;
                s_len[threadIdx.x] = 4096;
                s_dst[threadIdx.x] = (u64)(e & 0xfff) << 12;
            } else if (format == FMT_PACKED12) {
                s_src[threadIdx.x] = load_u32_volatile(list + 3 * i);
                s_len[threadIdx.x] = load_u32_volatile(list + 3 * i + 1);
                s_dst[threadIdx.x] = load_u32_volatile(list + 3 * i + 2);
            } else {
                const LoadMeta m = load_meta((const LoadMeta*)t.frags + i);
                s_src[threadIdx.x] = m.src_off;
                s_len[threadIdx.x] = m.len;
                s_dst[threadIdx.x] = m.dst_off;
            }
            fetched += s_len[threadIdx.x];
        }
        __syncthreads();
        if (!waited) {
            wait_for_previous_grid();
            signal_previous(sig);
            waited = true;
        }
        const u32 f = base + warp;
        if (f < t.count) {
            const u32 src_off = s_src[warp], len = s_len[warp];
            const u64 dst_off = s_dst[warp];
            if (len != 0) {
                const bool dst_ok = dst_off <= t.dst_len && (u64)len <= t.dst_len - dst_off;
                const bool src_ok = (u64)src_off + len <= t.bounce_len;
                if (!dst_ok || !src_ok) {
                    if (lane == 0) *(volatile u32*)err = 1u + ((blockIdx.y << 12) | (f & 0xfff));
                } else {
                    copy_fragment((const u8*)(t.bounce + src_off), (u8*)(t.dst + dst_off), len, lane);
                }
            }
        }
        __syncthreads();
    }
    return fetched;
}

template <int N>
__device__ __forceinline__ void unpack_body(const TaskArray<N>& tasks, u32* err, const Signal& sig) {
    allow_next_launch();
    bool waited = false;
    u64 fetched = unpack_rounds(tasks.t[blockIdx.y], err, sig, waited);
    if (!waited) {
        // A block with no round still waits before it stores anything, and signals.
        wait_for_previous_grid();
        signal_previous(sig);
    }
    if (sig.sums != 0 && threadIdx.x < 32) {
        // The fetching threads are the first WARPS_PER_BLOCK lanes of warp 0.
        for (u32 o = 16; o > 0; o >>= 1) fetched += __shfl_down_sync(0xffffffffu, fetched, o);
        if (threadIdx.x == 0) {
            const u32 v = fetched > 0xffffffffull ? 0xffffffffu : (u32)fetched;
            const u64 at = sig.sums + 4ull * (blockIdx.y * gridDim.x + blockIdx.x);
            asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(at), "r"(v) : "memory");
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    tcpxd_unpack_8(const __grid_constant__ TaskArray<8> tasks, u32* err, const Signal sig) {
    unpack_body<8>(tasks, err, sig);
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    tcpxd_unpack_16(const __grid_constant__ TaskArray<16> tasks, u32* err, const Signal sig) {
    unpack_body<16>(tasks, err, sig);
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    tcpxd_unpack_64(const __grid_constant__ TaskArray<64> tasks, u32* err, const Signal sig) {
    unpack_body<64>(tasks, err, sig);
}

// ---- fragment lists inline in the kernel parameters ------------------------------------------
// For small batches the host copies the lists into the launch's parameter block (12-byte
// entries, as destination offsets fit 32 bits), so no upload precedes the kernel. Only the
// variant under the classic 4 KiB parameter limit is kept: a 31 KiB parameter block (CUDA 12.1+)
// was measured slower than uploading the lists (docs/GPU.md).

struct InlineTask {
    u64 bounce;
    u64 bounce_len;
    u64 dst;
    u64 dst_len;
    u32 first;  // index of its first entry in `m`
    u32 count;
};

struct PackedMeta {
    u32 src_off;
    u32 len;
    u32 dst_off;
};

template <int T, int F>
struct InlineParams {
    InlineTask t[T];
    PackedMeta m[F];
};

template <int T, int F>
__device__ __forceinline__ void unpack_inline_body(const InlineParams<T, F>& p, u32* err) {
    const InlineTask& t = p.t[blockIdx.y];
    const u32 lane = threadIdx.x & 31;
    const u32 warps = gridDim.x * WARPS_PER_BLOCK;
    for (u32 f = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5); f < t.count; f += warps) {
        const PackedMeta m = p.m[t.first + f];
        if (m.len == 0) continue;
        const bool dst_ok = (u64)m.dst_off + m.len <= t.dst_len;
        const bool src_ok = (u64)m.src_off + m.len <= t.bounce_len;
        if (!dst_ok || !src_ok) {
            if (lane == 0) *(volatile u32*)err = 1u + ((blockIdx.y << 12) | (f & 0xfff));
            continue;
        }
        copy_fragment((const u8*)(t.bounce + m.src_off), (u8*)(t.dst + m.dst_off), m.len, lane);
    }
}

// 4 tasks, 256 entries: 3232 bytes, under the classic 4 KiB parameter limit.
extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    tcpxd_unpack_inline_small(const __grid_constant__ InlineParams<4, 256> p, u32* err, const Signal sig) {
    signal_previous(sig);  // a plain launch: the previous grids have completed
    unpack_inline_body<4, 256>(p, err);
}

// Whole-page lists inline: up to 16 receives and 2048 FMT_PAGE32 entries (8832 bytes of
// parameters, which needs the CUDA 12.1+ large-parameter launch). A 16 × 512 KiB batch of whole
// pages needs no upload and no read of host memory before its copies start.
template <int T, int F>
struct InlinePages {
    InlineTask t[T];
    u32 m[F];
};

__device__ __forceinline__ void unpack_inline_pages_body(const InlinePages<16, 2048>& p, u32* err) {
    const InlineTask& t = p.t[blockIdx.y];
    const u32 lane = threadIdx.x & 31;
    const u32 warps = gridDim.x * WARPS_PER_BLOCK;
    for (u32 f = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5); f < t.count; f += warps) {
        const u32 e = p.m[t.first + f];
        const u32 src_off = (e >> 12) << 12;
        const u32 dst_off = (e & 0xfff) << 12;
        const bool dst_ok = (u64)dst_off + 4096 <= t.dst_len;
        const bool src_ok = (u64)src_off + 4096 <= t.bounce_len;
        if (!dst_ok || !src_ok) {
            if (lane == 0) *(volatile u32*)err = 1u + ((blockIdx.y << 12) | (f & 0xfff));
            continue;
        }
        copy_fragment((const u8*)(t.bounce + src_off), (u8*)(t.dst + dst_off), 4096, lane);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    tcpxd_unpack_inline_pages(const __grid_constant__ InlinePages<16, 2048> p, u32* err, const Signal sig) {
    signal_previous(sig);  // a plain launch: the previous grids have completed
    unpack_inline_pages_body(p, err);
}
// ---- persistent mode ---------------------------------------------------------------------------
// One grid stays resident while batches keep coming: the host writes each batch's descriptor into
// pinned host memory and posts it by storing its sequence number last; no driver call per batch.
// Block 0 is the leader and copies nothing of the data: it polls the next descriptor over the host
// mapping, copies it and the batch's fragment lists into device memory, announces the batch
// (`go`) and goes on to the next, so lists cross PCIe ahead of the copies. Blocks 1.. take their
// share of each announced batch's work units (a unit is WARPS_PER_BLOCK fragments of one receive,
// one per warp) and the last to finish stores the batch's number into the host-mapped `done`
// word. After `linger_ns` without a new batch the leader ends the grid and says where it stopped
// (`exited`); the host launches a grid again for the next batch (or, if the two crossed, when it
// finds the batch untaken). Layouts must match src/gpu/persist.rs.

#define PERSIST_QUEUE 16
#define PERSIST_MAX_TASKS 64
#define PERSIST_STOP 0xffffffffu
#define EPOCH_SHIFT 40
#define SEQ_MASK ((1ull << EPOCH_SHIFT) - 1)
// Units whose fragment entries a block fetches together.
#define PERSIST_ROUND 4

struct __align__(16) PersistDesc {
    u64 seq;         // the batch's number once posted (written last by the host)
    u32 ntasks;      // receives; PERSIST_STOP: leave
    u32 units;       // work units in all
    u64 err;         // device address of the batch's error word
    u64 list_src;    // the batch's encoded lists: host-mapped address,
    u64 list_dst;    // where the leader copies them (the tasks' `frags` point there),
    u32 list_bytes;  // and their size (a multiple of 16)
    u32 pad0;
    u32 unit_first[PERSIST_MAX_TASKS + 1];  // first unit of each receive (prefix sums)
    u32 pad[3];
    UnpackTask tasks[PERSIST_MAX_TASKS];
};

struct PersistParams {
    u64 queue;      // PersistDesc[PERSIST_QUEUE], host-mapped (the host writes them)
    u64 scratch;    // PersistDesc[PERSIST_QUEUE], device memory (the leader copies each batch here)
    u64 ctl;        // device: u64 go, u64 stop, u32 counters[PERSIST_QUEUE]
    u64 done;       // host-mapped u64: the newest finished batch
    u64 exited;     // host-mapped u64: epoch << 40 | the first batch this grid did not take
    u64 first_seq;  // the first batch this grid takes
    u64 epoch;      // tags this launch's go/stop/exited values
    u64 linger_ns;
};

__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void st_volatile_u64(u64 addr, u64 v) {
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}

// Fetches fragment `f` of a list in device memory (L2, coherent) as (src_off, len, dst_off).
__device__ __forceinline__ void fetch_entry(u64 frags, u32 format, u32 f, u32& src, u32& len, u64& dst) {
    if (format == FMT_PAGE32) {
        const u32 e = __ldcg((const u32*)frags + f);
        src = (e >> 12) << 12;
        len = 4096;
        dst = (u64)(e & 0xfff) << 12;
    } else if (format == FMT_PACKED12) {
        const u32* l = (const u32*)frags + 3 * f;
        src = __ldcg(l);
        len = __ldcg(l + 1);
        dst = __ldcg(l + 2);
    } else {
        const u64* l = (const u64*)frags + 2 * f;
        const u64 a = __ldcg(l);
        src = (u32)a;
        len = (u32)(a >> 32);
        dst = __ldcg(l + 1);
    }
}

// The leader: stages batches into device memory ahead of the workers until the linger runs out
// or a stop descriptor comes.
__device__ void persist_lead(const PersistParams& p, volatile u64* go, volatile u64* stop) {
    __shared__ int s_posted;
    const u64 tag = p.epoch << EPOCH_SHIFT;
    for (u64 seq = p.first_seq;; seq++) {
        const u32 q = (u32)(seq % PERSIST_QUEUE);
        const PersistDesc* hd = (const PersistDesc*)p.queue + q;
        PersistDesc* dd = (PersistDesc*)p.scratch + q;
        if (threadIdx.x == 0) {
            const u64 t0 = globaltimer_ns();
            int posted = 0;
            for (;;) {
                if (ld_acquire_sys(&hd->seq) == seq) {
                    posted = 1;
                    break;
                }
                if (globaltimer_ns() - t0 > p.linger_ns) break;
            }
            s_posted = posted;
        }
        __syncthreads();
        const int posted = s_posted;
        if (posted) {
            const uint4* src = (const uint4*)hd;
            uint4* dst = (uint4*)dd;
            for (u32 i = threadIdx.x; i < sizeof(PersistDesc) / 16; i += blockDim.x) dst[i] = ld_volatile_v4(src + i);
            __syncthreads();
            const volatile PersistDesc* vd = dd;
            const u32 ntasks = vd->ntasks;
            if (ntasks != PERSIST_STOP) {
                const uint4* ls = (const uint4*)vd->list_src;
                uint4* ld = (uint4*)vd->list_dst;
                const u32 n = vd->list_bytes / 16;
                for (u32 i = threadIdx.x; i < n; i += blockDim.x) ld[i] = ld_volatile_v4(ls + i);
            }
            __threadfence();
            __syncthreads();
            if (ntasks != PERSIST_STOP) {
                if (threadIdx.x == 0) *go = tag | seq;
                continue;
            }
        }
        if (threadIdx.x == 0) {
            *stop = tag | seq;
            __threadfence_system();
            st_volatile_u64(p.exited, tag | seq);
        }
        return;
    }
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    tcpxd_unpack_persistent(const PersistParams p) {
    __shared__ int s_state;
    __shared__ u32 s_ntasks, s_units;
    __shared__ u64 s_err;
    __shared__ u32 s_first[PERSIST_MAX_TASKS + 1];
    __shared__ u32 s_task[PERSIST_ROUND];
    __shared__ u32 s_src[PERSIST_ROUND * WARPS_PER_BLOCK];
    __shared__ u32 s_len[PERSIST_ROUND * WARPS_PER_BLOCK];
    __shared__ u64 s_dst[PERSIST_ROUND * WARPS_PER_BLOCK];
    volatile u64* go = (volatile u64*)p.ctl;
    volatile u64* stop = go + 1;
    if (blockIdx.x == 0) {
        persist_lead(p, go, stop);
        return;
    }
    u32* counters = (u32*)(p.ctl + 16);
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 worker = blockIdx.x - 1, workers = gridDim.x - 1;

    for (u64 seq = p.first_seq;; seq++) {
        const u32 q = (u32)(seq % PERSIST_QUEUE);
        const PersistDesc* dd = (const PersistDesc*)p.scratch + q;
        // Wait for the leader to announce `seq`, or to stop at or before it.
        if (threadIdx.x == 0) {
            int st;
            for (;;) {
                const u64 g = *go;
                if ((g >> EPOCH_SHIFT) == p.epoch && (g & SEQ_MASK) >= seq) {
                    st = 1;
                    break;
                }
                const u64 s = *stop;
                if ((s >> EPOCH_SHIFT) == p.epoch && (s & SEQ_MASK) <= seq) {
                    st = 0;
                    break;
                }
                __nanosleep(64);
            }
            __threadfence();
            s_state = st;
            if (st) {
                s_ntasks = __ldcg(&dd->ntasks);
                s_units = __ldcg(&dd->units);
                s_err = __ldcg(&dd->err);
            }
        }
        __syncthreads();
        if (s_state == 0) return;
        const u32 ntasks = s_ntasks, units = s_units;
        u32* err = (u32*)s_err;
        for (u32 i = threadIdx.x; i <= ntasks; i += blockDim.x) s_first[i] = __ldcg(&dd->unit_first[i]);
        __syncthreads();

        for (u32 base = worker; base < units; base += PERSIST_ROUND * workers) {
            // The round's entries, together: thread r * WARPS_PER_BLOCK + w takes fragment w of
            // the round's unit r.
            if (threadIdx.x < PERSIST_ROUND * WARPS_PER_BLOCK) {
                const u32 r = threadIdx.x / WARPS_PER_BLOCK, w = threadIdx.x % WARPS_PER_BLOCK;
                const u32 u = base + r * workers;
                u32 src = 0, len = 0, task = 0;
                u64 dst = 0;
                if (u < units) {
                    u32 lo = 0, hi = ntasks;  // the last receive whose first unit is <= u
                    while (hi - lo > 1) {
                        const u32 mid = (lo + hi) / 2;
                        if (s_first[mid] <= u) lo = mid; else hi = mid;
                    }
                    task = lo;
                    const UnpackTask& t = dd->tasks[task];
                    const u32 f = (u - s_first[task]) * WARPS_PER_BLOCK + w;
                    if (f < __ldcg(&t.count)) fetch_entry(__ldcg(&t.frags), __ldcg(&t.format), f, src, len, dst);
                }
                s_src[threadIdx.x] = src;
                s_len[threadIdx.x] = len;
                s_dst[threadIdx.x] = dst;
                if (w == 0) s_task[r] = task;
            }
            __syncthreads();
            for (u32 r = 0; r < PERSIST_ROUND; r++) {
                const u32 u = base + r * workers;
                if (u >= units) break;
                const u32 i = r * WARPS_PER_BLOCK + warp;
                const u32 len = s_len[i];
                if (len == 0) continue;
                const u32 task = s_task[r];
                const UnpackTask& t = dd->tasks[task];
                const u64 bounce = __ldcg(&t.bounce), bounce_len = __ldcg(&t.bounce_len);
                const u64 dstp = __ldcg(&t.dst), dst_len = __ldcg(&t.dst_len);
                const u32 src_off = s_src[i];
                const u64 dst_off = s_dst[i];
                const bool dst_ok = dst_off <= dst_len && (u64)len <= dst_len - dst_off;
                const bool src_ok = (u64)src_off + len <= bounce_len;
                if (!dst_ok || !src_ok) {
                    const u32 f = (u - s_first[task]) * WARPS_PER_BLOCK + warp;
                    if (lane == 0) *(volatile u32*)err = 1u + ((task << 12) | (f & 0xfff));
                    continue;
                }
                copy_fragment<true>((const u8*)(bounce + src_off), (u8*)(dstp + dst_off), len, lane);
            }
            __syncthreads();
        }

        // Count this block done with `seq`; the last one tells the host.
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            if (atomicAdd(&counters[q], 1u) == workers - 1) {
                *(volatile u32*)&counters[q] = 0;
                __threadfence_system();
                st_volatile_u64(p.done, seq);
                __threadfence_system();
            }
        }
        __syncthreads();
    }
}
