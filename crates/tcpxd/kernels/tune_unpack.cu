// Tuning harness for kernels/unpack.cu (not part of the build): times the unpack kernel alone,
// with the fragment lists already in device memory, against one contiguous cudaMemcpyAsync of the
// same bytes, for 1, 4 and 16 chunks of 512 KiB made of shuffled 4 KiB pages (sources rotating
// through 256 MiB). Build one binary per knob setting, e.g.
//   nvcc -O3 -arch=sm_90 -DUNPACK_LOAD=2 -DVARIANT='"ldg-l2pf"' -o tune kernels/tune_unpack.cu
// and run it; each prints one line per batch size. Checks the bytes of the last batch.
// TUNE_MODES=1 instead times the production launch variants at 16 chunks: lists in device or
// host-mapped memory, with or without the completion signal and per-block sums, with or without
// programmatic dependent launch (TUNE_ONLY_PDL=1: only with).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstring>

#include "unpack.cu"

#ifndef VARIANT
#define VARIANT "default"
#endif

#define CK(x)                                                                            \
    do {                                                                                 \
        cudaError_t e_ = (x);                                                            \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

__global__ void fill_kernel(u64* p, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        p[i] = (i * 0x9E3779B97F4A7C15ull) ^ (i >> 7);
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    const size_t chunk = 512 << 10, page = 4096, bounce_len = 256ull << 20;
    const int fpc = chunk / page, windows = bounce_len / chunk, sets = 8, max_chunks = 16;
    u8 *bounce, *dst;
    LoadMeta* lists;
    u32* err;
    CK(cudaMalloc(&bounce, bounce_len));
    CK(cudaMalloc(&dst, (size_t)sets * max_chunks * chunk));
    CK(cudaMalloc(&lists, (size_t)windows * fpc * sizeof(LoadMeta)));
    CK(cudaMalloc(&err, 4));
    CK(cudaMemset(err, 0, 4));
    fill_kernel<<<1024, 256>>>((u64*)bounce, bounce_len / 8);
    std::vector<LoadMeta> h((size_t)windows * fpc);
    srand(1);
    for (int w = 0; w < windows; w++) {
        std::vector<int> perm(fpc);
        for (int i = 0; i < fpc; i++) perm[i] = i;
        for (int i = fpc - 1; i > 0; i--) std::swap(perm[i], perm[rand() % (i + 1)]);
        for (int i = 0; i < fpc; i++) {
            LoadMeta m;
            m.src_off = (u32)(w * chunk + perm[i] * page);
            m.len = page;
            m.dst_off = (u64)i * page;
            h[(size_t)w * fpc + i] = m;
        }
        for (int i = fpc - 1; i > 0; i--) std::swap(h[(size_t)w * fpc + i], h[(size_t)w * fpc + rand() % (i + 1)]);
    }
    CK(cudaMemcpy(lists, h.data(), h.size() * sizeof(LoadMeta), cudaMemcpyHostToDevice));
    // The same lists in host-mapped memory (as the plugin's ring), and the host-mapped done word
    // the production launches write.
    LoadMeta* hlists;
    CK(cudaHostAlloc((void**)&hlists, h.size() * sizeof(LoadMeta), cudaHostAllocMapped));
    memcpy(hlists, h.data(), h.size() * sizeof(LoadMeta));
    u64* done;
    CK(cudaHostAlloc((void**)&done, 8, cudaHostAllocMapped));
    u32* sums;
    CK(cudaHostAlloc((void**)&sums, 64 * 256 * 4, cudaHostAllocMapped));
    *done = 0;
    u64 seq = 1;
    const char* mode_env = getenv("TUNE_MODES");
    const bool modes = mode_env != nullptr && atoi(mode_env) != 0;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    const int blocks = (fpc + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;

    auto tasks_for = [&](int it, int chunks) {
        TaskArray<64> t;
        memset(&t, 0, sizeof t);
        for (int c = 0; c < chunks; c++) {
            int w = (it * chunks + c) % windows;
            t.t[c].frags = (u64)(lists + (size_t)w * fpc);
            t.t[c].bounce = (u64)bounce;
            t.t[c].bounce_len = bounce_len;
            t.t[c].dst = (u64)(dst + ((size_t)(it % sets) * max_chunks + c) * chunk);
            t.t[c].dst_len = chunk;
            t.t[c].count = fpc;
        }
        return t;
    };
    auto launch = [&](int it, int chunks) {
        TaskArray<64> t = tasks_for(it, chunks);
        tcpxd_unpack_64<<<dim3(blocks, chunks), WARPS_PER_BLOCK * 32, 0, st>>>(t, err, Signal{0, 0, 0});
    };
    // TUNE_MODES=1: the production variants. mapped: lists read from host memory; sig: counter,
    // exact totals and done word; pdl: programmatic dependent launch.
    // sig: 0 none, 1 the production launch: the previous batch's number stored (signal_previous),
    // each block's sum of lengths stored.
    auto launch_mode = [&](int it, int chunks, bool mapped, int sig, bool pdl) {
        TaskArray<16> t;
        memset(&t, 0, sizeof t);
        TaskArray<64> full = tasks_for(it, chunks);
        for (int c = 0; c < chunks; c++) {
            t.t[c] = full.t[c];
            if (mapped) t.t[c].frags = (u64)hlists + (t.t[c].frags - (u64)lists);
        }
        Signal sg{0, 0};
        if (sig) sg = Signal{(u64)done, seq++, (u64)sums};
        cudaLaunchConfig_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.gridDim = dim3(blocks, chunks);
        cfg.blockDim = dim3(WARPS_PER_BLOCK * 32);
        cfg.stream = st;
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = pdl ? 1 : 0;
        CK(cudaLaunchKernelEx(&cfg, tcpxd_unpack_16, t, err, sg));
    };
    auto contig = [&](int it, int chunks) {
        int w = (it * chunks) % (windows - chunks + 1);
        CK(cudaMemcpyAsync(dst + (size_t)(it % sets) * max_chunks * chunk, bounce + (size_t)w * chunk,
                           chunks * chunk, cudaMemcpyDeviceToDevice, st));
    };
    // Single launches (`singles`, the first 10 untimed), then 7 rounds of 64 back to back: medians.
    auto time_op = [&](auto op, int singles, float& single_us, float& pipe_us) {
        std::vector<float> single, pipe;
        for (int it = 0; it < singles; it++) {
            CK(cudaEventRecord(a, st));
            op(it);
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            if (it >= 10) single.push_back(ms * 1000);
        }
        for (int rep = 0; rep < 8; rep++) {
            CK(cudaEventRecord(a, st));
            for (int k = 0; k < 64; k++) op(rep * 64 + k);
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            if (rep > 0) pipe.push_back(ms * 1000 / 64);
        }
        single_us = median(single);
        pipe_us = median(pipe);
    };
    if (modes) {
        const int chunks = 16;
        float cs, cp;
        time_op([&](int it) { contig(it, chunks); }, 210, cs, cp);
        printf("%-14s contig              %6.1f us (pipe %5.1f)\n", VARIANT, cs, cp);
        const char* only = getenv("TUNE_ONLY_PDL");
        for (int m = 0; m < 8; m++) {
            bool mapped = m & 1, pdl = m & 2;
            int sig = m >> 2;
            if (only && !pdl) continue;
            float ks, kp;
            time_op([&](int it) { launch_mode(it, chunks, mapped, sig, pdl); }, 210, ks, kp);
            CK(cudaStreamSynchronize(st));
            u32 e;
            CK(cudaMemcpy(&e, err, 4, cudaMemcpyDeviceToHost));
            printf("%-14s lists=%-6s sig=%d pdl=%d %6.1f us (pipe %5.1f) | x%.2f (pipe x%.2f) %s%s\n", VARIANT,
                   mapped ? "mapped" : "device", sig, pdl, ks, kp, ks / cs, kp / cp, e == 0 ? "ok" : "ERR",
                   sig && *(volatile u64*)done + 1 != seq ? " (done word behind)" : "");
        }
        return 0;
    }
    for (int chunks : {1, 4, 16}) {
        float res[4];
        for (int mode = 0; mode < 2; mode++) {
            auto op = [&](int it) { mode == 0 ? launch(it, chunks) : contig(it, chunks); };
            time_op(op, 110, res[mode * 2], res[mode * 2 + 1]);
        }
        // Check the last kernel batch of this size.
        int it = 7 * 64 + 63;
        launch(it, chunks);
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        bool ok = true;
        std::vector<u8> got(chunk), src(chunk);
        for (int c = 0; c < chunks && ok; c += chunks > 1 ? chunks - 1 : 1) {
            int w = (it * chunks + c) % windows;
            CK(cudaMemcpy(got.data(), dst + ((size_t)(it % sets) * max_chunks + c) * chunk, chunk, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(src.data(), bounce + (size_t)w * chunk, chunk, cudaMemcpyDeviceToHost));
            for (int i = 0; i < fpc; i++) {
                const LoadMeta& m = h[(size_t)w * fpc + i];
                ok = ok && memcmp(got.data() + m.dst_off, src.data() + (m.src_off - w * chunk), page) == 0;
            }
        }
        u32 e;
        CK(cudaMemcpy(&e, err, 4, cudaMemcpyDeviceToHost));
        printf("%-14s wpb=%-2d unroll=%d load=%d chunks=%-2d kernel %6.1f us (pipe %5.1f) | contig %6.1f us (pipe %5.1f) | x%.2f (pipe x%.2f) %s\n",
               VARIANT, WARPS_PER_BLOCK, UNROLL, UNPACK_LOAD, chunks, res[0], res[1], res[2], res[3], res[0] / res[2],
               res[1] / res[3], ok && e == 0 ? "ok" : "WRONG");
    }
    return 0;
}
