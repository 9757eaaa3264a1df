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

// Warp-cooperative copy of `len` bytes where `src` and `dst` agree modulo sizeof(T): byte head
// until aligned, then T-wide words (UNROLL loads in flight per lane), then a byte tail.
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
    for (; i + 32 * (UNROLL - 1) < n; i += 32 * UNROLL) {
        T v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) v[u] = load_nc(s + i + 32 * u);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) d[i + 32 * u] = v[u];
    }
    // The rest (fewer than UNROLL rounds): all loads first, so it costs one round trip too.
    if (i < n) {
        T v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            if (i + 32 * u < n) v[u] = load_nc(s + i + 32 * u);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            if (i + 32 * u < n) d[i + 32 * u] = v[u];
    }
    const u32 done = n * w;
    if (lane < len - done) dst[done + lane] = src[done + lane];
}

__device__ __forceinline__ void copy_fragment(const u8* src, u8* dst, u32 len, u32 lane) {
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

// `err` (host-mapped) receives 1 + (task << 12 | fragment) of a fragment that would read or write
// out of bounds; such fragments are skipped. The host validates first, so this is a guard only.
__device__ __forceinline__ u32 load_u32_volatile(const u32* p) {
    u32 v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Completion without a CUDA event: the last block of a batch's final launch stores the batch's
// sequence number into `done` (a host-mapped u64 the host polls with a plain load) once every block
// of the launch has finished its stores. `counter` (device memory, zero between launches) counts
// finished blocks; launches of one unpacker run one after another on its stream, so one counter
// serves them all. done == 0: not the batch's last launch, no signal.
struct Signal {
    u64 done;
    u64 counter;
    u64 value;
};

__device__ __forceinline__ void signal_done(const Signal& s) {
    if (s.done == 0) return;
    __threadfence();  // this thread's stores, device-wide, before the block is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* counter = (u32*)s.counter;
        if (atomicAdd(counter, 1u) == gridDim.x * gridDim.y - 1) {
            *(volatile u32*)counter = 0;  // for the next launch (it starts after this one ends)
            __threadfence_system();        // every block's stores before the host sees `value`
            asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(s.done), "l"(s.value) : "memory");
        }
    }
}

// Compact lists: each round, the block's first WARPS_PER_BLOCK threads fetch the round's entries
// together (one small coalesced read, which matters when the list is read across PCIe), then each
// warp copies one fragment.
__device__ __forceinline__ void unpack_compact(const UnpackTask& t, u32* err) {
    __shared__ u32 s_src[WARPS_PER_BLOCK];
    __shared__ u32 s_len[WARPS_PER_BLOCK];
    __shared__ u32 s_dst[WARPS_PER_BLOCK];
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32* list = (const u32*)t.frags;
    for (u32 base = blockIdx.x * WARPS_PER_BLOCK; base < t.count; base += gridDim.x * WARPS_PER_BLOCK) {
        const u32 i = base + threadIdx.x;
        if (threadIdx.x < WARPS_PER_BLOCK && i < t.count) {
            if (t.format == FMT_PAGE32) {
                const u32 e = load_u32_volatile(list + i);
                s_src[threadIdx.x] = (e >> 12) << 12;
                s_len[threadIdx.x] = 4096;
                s_dst[threadIdx.x] = (e & 0xfff) << 12;
            } else {
                s_src[threadIdx.x] = load_u32_volatile(list + 3 * i);
                s_len[threadIdx.x] = load_u32_volatile(list + 3 * i + 1);
                s_dst[threadIdx.x] = load_u32_volatile(list + 3 * i + 2);
            }
        }
        __syncthreads();
        const u32 f = base + warp;
        if (f < t.count) {
            const u32 src_off = s_src[warp], len = s_len[warp], dst_off = s_dst[warp];
            if (len != 0) {
                const bool dst_ok = (u64)dst_off + len <= t.dst_len;
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
}

template <int N>
__device__ __forceinline__ void unpack_body(const TaskArray<N>& tasks, u32* err) {
    const UnpackTask& t = tasks.t[blockIdx.y];
    if (t.format != FMT_META) {
        unpack_compact(t, err);
        return;
    }
    const u32 lane = threadIdx.x & 31;
    const u32 warps = gridDim.x * WARPS_PER_BLOCK;
    const LoadMeta* frags = (const LoadMeta*)t.frags;
    for (u32 f = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5); f < t.count; f += warps) {
        const LoadMeta m = load_meta(frags + f);
        if (m.len == 0) continue;
        const bool dst_ok = m.dst_off <= t.dst_len && (u64)m.len <= t.dst_len - m.dst_off;
        const bool src_ok = (u64)m.src_off <= t.bounce_len && (u64)m.len <= t.bounce_len - m.src_off;
        if (!dst_ok || !src_ok) {
            if (lane == 0) *(volatile u32*)err = 1u + ((blockIdx.y << 12) | (f & 0xfff));
            continue;
        }
        copy_fragment((const u8*)(t.bounce + m.src_off), (u8*)(t.dst + m.dst_off), m.len, lane);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    tcpxd_unpack_8(const __grid_constant__ TaskArray<8> tasks, u32* err, const Signal sig) {
    unpack_body<8>(tasks, err);
    signal_done(sig);
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    tcpxd_unpack_16(const __grid_constant__ TaskArray<16> tasks, u32* err, const Signal sig) {
    unpack_body<16>(tasks, err);
    signal_done(sig);
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
    tcpxd_unpack_64(const __grid_constant__ TaskArray<64> tasks, u32* err, const Signal sig) {
    unpack_body<64>(tasks, err);
    signal_done(sig);
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
    unpack_inline_body<4, 256>(p, err);
    signal_done(sig);
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
    unpack_inline_pages_body(p, err);
    signal_done(sig);
}