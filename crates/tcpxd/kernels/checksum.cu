// tcpxd checksum kernel: the CRC-32C (Castagnoli, as the `crc32c` crate computes it) of every
// 4 KiB block of a range, one thread per block, slicing-by-8 with tables in shared memory. The host
// folds the per-block values into the CRC of the whole range (src/gpu/ops.rs).
//
// Compiled by nvcc at build time or by NVRTC at start-up: no headers.

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

#define CRC_BLOCK 4096u
#define POLY 0x82F63B78u  // reflected Castagnoli polynomial

// out[i] = crc32c(data[i * 4096 .. min(len, (i + 1) * 4096)]).
extern "C" __global__ void __launch_bounds__(256) tcpxd_crc32c_blocks(const u8* data, u64 len, u32* out) {
    __shared__ u32 table[8][256];
    // table[k][b]: the raw CRC register after byte b followed by k zero bytes.
    for (u32 idx = threadIdx.x; idx < 8 * 256; idx += blockDim.x) {
        u32 k = idx >> 8;
        u32 c = idx & 255;
        for (u32 bit = 0; bit < 8 * (k + 1); bit++) c = (c & 1) ? (c >> 1) ^ POLY : (c >> 1);
        table[k][idx & 255] = c;
    }
    __syncthreads();

    const u64 nblocks = (len + CRC_BLOCK - 1) / CRC_BLOCK;
    for (u64 b = blockIdx.x * (u64)blockDim.x + threadIdx.x; b < nblocks; b += (u64)gridDim.x * blockDim.x) {
        const u8* p = data + b * CRC_BLOCK;
        u64 n = len - b * CRC_BLOCK;
        if (n > CRC_BLOCK) n = CRC_BLOCK;
        u32 crc = 0xFFFFFFFFu;
        u64 i = 0;
        if (((u64)p & 15) == 0) {
            const uint4* q = (const uint4*)p;
            for (; i + 16 <= n; i += 16) {
                uint4 v = __ldg(q + i / 16);
                u32 lo = crc ^ v.x;
                crc = table[7][lo & 255] ^ table[6][(lo >> 8) & 255] ^ table[5][(lo >> 16) & 255] ^
                      table[4][lo >> 24] ^ table[3][v.y & 255] ^ table[2][(v.y >> 8) & 255] ^
                      table[1][(v.y >> 16) & 255] ^ table[0][v.y >> 24];
                lo = crc ^ v.z;
                crc = table[7][lo & 255] ^ table[6][(lo >> 8) & 255] ^ table[5][(lo >> 16) & 255] ^
                      table[4][lo >> 24] ^ table[3][v.w & 255] ^ table[2][(v.w >> 8) & 255] ^
                      table[1][(v.w >> 16) & 255] ^ table[0][v.w >> 24];
            }
        }
        for (; i < n; i++) crc = table[0][(crc ^ p[i]) & 255] ^ (crc >> 8);
        out[b] = crc ^ 0xFFFFFFFFu;
    }
}
