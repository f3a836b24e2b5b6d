// EXL3 decode-round products (issue 30): y = H(H(x * suh) . W~) * svh (+ bias) for up to 64 rows a block, W~ the
// trellis-decoded matrix, decoded in registers and fed to the tensor cores (mma.sync m16n8k16, fp16 in, fp32 sums);
// for sm_80+. No headers: NVRTC or nvcc compile this file as it is (kernels/cuda.py); kernels/exl3.py launches it.
// The decode helpers are __host__ __device__ so tests/test_exl3_cuda.py checks them on the CPU (EXL3_HOST_TEST).
//
// One launch does the whole linear:
//   input Hadamard   each block rotates the 128-column blocks of x it needs (x * suh, 128-point Walsh-Hadamard in
//                    fp32 butterflies, * fp32(1/sqrt(128)), rounded to fp16: the MMA's B operand) in shared memory;
//   product          the weight is the MMA's A operand: a 16x16 trellis tile is exactly one A fragment (the tile's
//                    position order is the tensor-core lane order), so lane l decodes its 8 positions 8l..8l+7 and
//                    holds them as the 4 registers of the fragment, no shuffles. A block owns 128 output columns (8
//                    tiles; warp w the tiles 2w, 2w+1) and a chunk of whole 128-row blocks of the input; the
//                    trellis of a (4 k-tiles x 8 n-tiles) stage is 4 contiguous runs of bytes, copied with 16-byte
//                    cp.async into a ring of stages in flight ahead of the decode (each byte read once);
//   split-K          the input is cut into S chunks chosen from the weight's shape only; the last of the S blocks
//                    of a column block to finish (an arrival counter, reset by it) adds the partials
//                    0 + p_0 + ... + p_{S-1} in order;
//   output Hadamard  that block (or the only one, S = 1) rotates its 128 columns (they are one Hadamard block), * svh,
//                    + bias, and stores y.
// Grouped launch (routed experts): blockIdx.z runs over (group, 64-row block) pairs, group g multiplied by expert
// ids[g] of a stack, rows[g] of its M rows valid.
//
// Batch invariance by construction: a row's input rotation is its own; every output element is the same chain of
// MMAs over the same k order whatever the row count (row tiles of 8 beyond the rows are skipped whole, a row's MMA
// column is its own); the split depends on the shape only and the partials are added in split order.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define HD __host__ __device__ __forceinline__
#define CX __host__ __device__ static constexpr
#define DEVI __device__ __forceinline__
#else
#define HD inline
#define CX static constexpr
#endif

// ---- the trellis layout (host and device) ----------------------------------------------------------------------

// K = K2 / 2 bits a weight. A tile is a ring of 128*K2 bits in 4*K2 32-bit words (int16 pairs, little-endian),
// read most significant bit first; the 16-bit window of position p ends at bit end(p) (half-integer K: the odd
// positions of each 16 carry KA + 1 bits).
template <int K2>
struct Rate {
    static constexpr int KA = K2 / 2, HALF = K2 & 1, NW = 4 * K2, RING = 128 * K2;
    CX int end(int p) { return (p >> 4) * 8 * K2 + ((p & 15) + 1) * KA + HALF * (((p & 15) + 1) >> 1); }
    // where lane l's first window starts, and the offset of its window j from there: lane l holds positions
    // 8l..8l+7, which start at an even position of a group of 16 (8l & 15 is 0 or 8), so the offsets are the same
    // for every lane
    CX int start(int lane) { return (end(8 * lane) - 16 + RING) % RING; }
    CX int off(int j) { return end(j) - end(0); }
    static constexpr int SPAN = end(7) - end(0) + 16;                   // bits a lane's 8 windows cover
    CX int max_align() {
        int m = 0;
        for (int l = 0; l < 32; ++l) m = (start(l) & 31) > m ? (start(l) & 31) : m;
        return m;
    }
    static constexpr int NWL = (max_align() + SPAN + 31) / 32;         // words a lane loads per tile
    static constexpr int NR = (SPAN + 31) / 32;                        // registers after aligning to window 0
    CX bool same_align() {
        for (int l = 1; l < 32; ++l)
            if ((start(l) & 31) != (start(0) & 31)) return false;
        return true;
    }
    // every lane's first window at the same bit of its first word (K = 4, 8): the windows are compile-time
    // offsets in the loaded words themselves, no aligning shift
    static constexpr bool FIXED = same_align();
    static constexpr int A0 = start(0) & 31;
};

HD u32 shl_funnel(u32 hi, u32 lo, int a) {                            // the top 32 bits of (hi:lo) << a, a in 0..31
#if defined(__CUDA_ARCH__)
    u32 r;
    asm("shf.l.wrap.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(a));
    return r;
#else
    return a ? (hi << a) | (lo >> (32 - a)) : hi;
#endif
}

// The 16-bit window at bit `o` (a compile-time offset, o + 16 <= 32 * NR) of the aligned registers R (MSB first).
template <int O>
HD u32 window(const u32* R) {
    constexpr int r = O >> 5, s = O & 31;
    if constexpr (s == 0) return R[r] >> 16;
    else if constexpr (s <= 16) return (R[r] >> (16 - s)) & 0xFFFFu;
    else return shl_funnel(R[r], R[r + 1], s) >> 16;
}

// ---- codebooks: two windows -> an fp16 pair (first in the low half), exllamav3's codebook.cuh -------------------

enum { CB_3INST = 0, CB_MCG = 1, CB_MUL1 = 2 };

#if !defined(__CUDA_ARCH__)
// host emulation (the test harness): each value rounded once to fp16, as the device's f16x2 instructions do
inline u16 f16_bits(double v) {                                        // round to nearest even, normal or subnormal
    u16 sign = v < 0 ? 0x8000 : 0;
    double a = v < 0 ? -v : v;
    if (a == 0) return sign;
    int e = 0;
    double p = 1.0;                                                      // 2^e <= a < 2^(e+1)
    while (a >= 2 * p) { p *= 2; ++e; }
    while (a < p) { p /= 2; --e; }
    int ee = e < -14 ? -14 : e;                                          // subnormals: the unit is 2^-24
    double unit = 1.0;
    for (int i = 0; i < ee - 10; ++i) unit *= 2;
    for (int i = 0; i < 10 - ee; ++i) unit /= 2;
    double q = a / unit, fl = (double)(long long)q;
    long long m = (long long)fl;
    if (q - fl > 0.5 || (q - fl == 0.5 && (m & 1))) ++m;
    if (m == 2048) { m = 1024; ++ee; }
    if (m < 1024) return sign | (u16)m;                                 // subnormal
    return sign | (u16)(((ee + 15) << 10) | (m - 1024));
}

inline double f16_value(u32 h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e ? (1024 + m) * ((e - 25) >= 0 ? (double)(1 << (e - 25)) : 1.0 / (double)(1LL << (25 - e)))
                 : m / 16777216.0;
    return (h & 0x8000) ? -v : v;
}

template <int CB>
inline u32 codebook_pair(u32 w0, u32 w1) {
    u32 r[2], w[2] = {w0, w1};
    for (int i = 0; i < 2; ++i) {
        if (CB == CB_MUL1) {
            u32 x = w[i] * 0x83DCD12Du;
            u32 s = 0x6400u + (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24);
            r[i] = f16_bits(f16_value(s) * f16_value(0x1EEE) + f16_value(0xC931));
        } else {
            u32 x = CB == CB_MCG ? w[i] * 0xCBAC1FEDu : w[i] * 89226354u + 64248484u;
            x = (x & 0x8FFF8FFFu) ^ 0x3B603B60u;
            r[i] = f16_bits(f16_value(x & 0xFFFF) + f16_value(x >> 16));
        }
    }
    return r[0] | (r[1] << 16);
}
#else
DEVI u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

template <int CB>
DEVI u32 codebook_pair(u32 w0, u32 w1) {
    u32 r;
    if (CB == CB_MUL1) {
        // 1024 + the byte sum of w * 0x83DCD12D read as fp16, times fp16(0x1eee) plus fp16(0xc931): one fp16 fma
        u32 x0 = w0 * 0x83DCD12Du, x1 = w1 * 0x83DCD12Du, s0, s1;
        asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(s0) : "r"(x0), "r"(0x01010101u), "r"(0x6400u));
        asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(s1) : "r"(x1), "r"(0x01010101u), "r"(0x6400u));
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(prmt(s0, s1, 0x5410)), "r"(0x1EEE1EEEu), "r"(0xC931C931u));
    } else {
        // 3INST / MCG: x = w * a (+ b), (x & 0x8fff8fff) ^ 0x3b603b60 is two fp16 values, their sum (one rounding)
        u32 x0 = CB == CB_MCG ? w0 * 0xCBAC1FEDu : w0 * 89226354u + 64248484u;
        u32 x1 = CB == CB_MCG ? w1 * 0xCBAC1FEDu : w1 * 89226354u + 64248484u;
        // (x & 0x8fff8fff) ^ 0x3b603b60 as one lop3 (the compiler split it in two)
        asm("lop3.b32 %0, %0, 0x8FFF8FFF, 0x3B603B60, 0x6A;" : "+r"(x0));
        asm("lop3.b32 %0, %0, 0x8FFF8FFF, 0x3B603B60, 0x6A;" : "+r"(x1));
        asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(prmt(x0, x1, 0x5410)), "r"(prmt(x0, x1, 0x7632)));
    }
    return r;
}
#endif

// Lane l's A fragment of one tile from its NWL words (W[q] = tile word (i0 + q) mod NW, i0 = start(l) / 32) and
// a = start(l) % 32. Positions 8l + j: j & 1 -> k + 1, j & 2 -> k + 8, j & 4 -> n + 8 (k = 2(l % 4), n = l / 4);
// the m16n8k16 A fragment (rows n, columns k) is a0 = (n, k | k+1), a1 = (n+8, k | k+1), a2 = (n, k+8 | k+9),
// a3 = (n+8, k+8 | k+9): windows (0, 1), (4, 5), (2, 3), (6, 7).
template <int K2, int CB>
HD void lane_fragment(const u32* W, int a, u32* frag) {
    typedef Rate<K2> R_;
    if constexpr (R_::FIXED) {
        constexpr int A = R_::A0;
        frag[0] = codebook_pair<CB>(window<A + R_::off(0)>(W), window<A + R_::off(1)>(W));
        frag[1] = codebook_pair<CB>(window<A + R_::off(4)>(W), window<A + R_::off(5)>(W));
        frag[2] = codebook_pair<CB>(window<A + R_::off(2)>(W), window<A + R_::off(3)>(W));
        frag[3] = codebook_pair<CB>(window<A + R_::off(6)>(W), window<A + R_::off(7)>(W));
    } else {
        u32 R[R_::NR];
#pragma unroll
        for (int r = 0; r < R_::NR; ++r) R[r] = shl_funnel(W[r], r + 1 < R_::NWL ? W[r + 1] : 0u, a);
        frag[0] = codebook_pair<CB>(window<R_::off(0)>(R), window<R_::off(1)>(R));
        frag[1] = codebook_pair<CB>(window<R_::off(4)>(R), window<R_::off(5)>(R));
        frag[2] = codebook_pair<CB>(window<R_::off(2)>(R), window<R_::off(3)>(R));
        frag[3] = codebook_pair<CB>(window<R_::off(6)>(R), window<R_::off(7)>(R));
    }
}

#if !defined(EXL3_HOST_TEST)

// ---- device helpers ---------------------------------------------------------------------------------------------

DEVI void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

DEVI u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

DEVI void cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}

DEVI void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
DEVI void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

DEVI float ld_cg(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

// Programmatic dependent launch (kernels/cuda.py launch(pdl=True)): wait for the stream's previous kernel (its
// writes visible), and let the next one start launching. Both are no-ops for a plain launch.
DEVI void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

DEVI void griddep_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

DEVI u32 ld_stream(const u32* p) {                                  // read once: not kept in L1
    u32 r;
    asm volatile("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// fp32 multiply and add with explicit rounding: never contracted into an fma, so the Hadamards and the scales are
// the same operations in every instantiation (and the reference's order: butterflies, * scale, * svh, + bias)
DEVI float fmul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

DEVI float fadd(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

DEVI float fsub(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

DEVI float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

DEVI u32 pack_f16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

constexpr float HAD_SCALE = 0.08838834764831845f;                  // fp32(1/sqrt(128)), as exllamav3's H
constexpr int BN = 128;                                             // output columns a block (one Hadamard block)
constexpr int KT_STAGE = 4;                                         // k-tiles (16 input rows) a ring stage

// In-place 128-point Walsh-Hadamard (Sylvester order) of a warp's row: lane l holds columns 4l..4l+3 in v.
// Butterflies (a, b) -> (a + b, a - b) over index bits 0..6 in order: the same fp32 operations for every row.
DEVI void wht128(float* v, int lane) {
    float a0 = fadd(v[0], v[1]), a1 = fsub(v[0], v[1]), a2 = fadd(v[2], v[3]), a3 = fsub(v[2], v[3]);
    v[0] = fadd(a0, a2);
    v[1] = fadd(a1, a3);
    v[2] = fsub(a0, a2);
    v[3] = fsub(a1, a3);
#pragma unroll
    for (int b = 0; b < 5; ++b) {
        const bool upper = (lane >> b) & 1;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float o = __shfl_xor_sync(0xffffffffu, v[i], 1 << b);
            v[i] = upper ? fsub(o, v[i]) : fadd(v[i], o);
        }
    }
}

template <int K2>
struct Ring {
    static constexpr int STAGE = KT_STAGE * (BN / 16) * 16 * K2;       // bytes: 4 k-tiles x 8 n-tiles x 16K bytes
    static constexpr int PF = K2 <= 8 ? 4 : 3;                          // stages in flight
    static constexpr int CHUNKS = STAGE / 16;                           // 16-byte copies a stage
};

template <int MAXT>
struct Xs {
    // the rotated x of XH 128-row input blocks at a time (one row tile: up to 8 blocks, so the x loads of a chunk
    // are issued together instead of one latency a block; eight row tiles: one block)
    static constexpr int XH = MAXT == 1 ? 8 : 1;
    static constexpr int LD = XH * 128 + 8;                             // fp16 row stride (halves)
    static constexpr int BYTES = 8 * MAXT * LD * 2;
    static constexpr int YLD = BN + 4;                                  // fp32 row stride of the output rows
    static constexpr int YBYTES = 8 * MAXT * YLD * 4;
};

// The register-direct form's loop (RD, a bench form): each warp loads its own two n-tiles' words from global memory
// into registers one stage ahead of their decode (no shared-memory ring, no copies to wait for); barriers only around
// the input rotations. The same rotation, decode and MMA chain as the ring forms in exl3_body, so the same bits.
template <int K2, int CB, int MAXT, int DIAG>
DEVI void exl3_rd_loop(float (&acc)[2][MAXT][4], const u32* wexp, const float* x, const u16* su, const int* xmap,
                       u16* xs, const u32* xlane, int NT, int nt0, int h_lo, int h_hi, int nst, int nrw, int R,
                       int live, int D, long long row0, int a_shift, int st, bool early) {
    typedef Rate<K2> R_;
    typedef Xs<MAXT> XS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32* lw[R_::NWL];                                // this lane's words of stage 0's tile (0, 0)
#pragma unroll
    for (int q = 0; q < R_::NWL; ++q)
        lw[q] = wexp + ((long long)h_lo * 8 * NT + nt0 + 2 * warp) * R_::NW + ((st >> 5) + q) % R_::NW;
    const long long kt_step = (long long)NT * R_::NW;      // words from one k-tile to the next
    u32 wa[KT_STAGE][2][R_::NWL], wb[KT_STAGE][2][R_::NWL];
    auto load = [&](int s, u32 (&buf)[KT_STAGE][2][R_::NWL]) {
        if (s < nst) {
#pragma unroll
            for (int kk = 0; kk < KT_STAGE; ++kk)
#pragma unroll
                for (int nn = 0; nn < 2; ++nn)
#pragma unroll
                    for (int q = 0; q < R_::NWL; ++q)
                        buf[kk][nn][q] = ld_stream(lw[q] + (s * KT_STAGE + kk) * kt_step + nn * R_::NW);
        }
    };
    auto step = [&](int s, u32 (&use)[KT_STAGE][2][R_::NWL], u32 (&fill)[KT_STAGE][2][R_::NWL]) {
        if ((s & 1) == 0 && (s >> 1) % XS::XH == 0) {
            __syncthreads();                               // everyone is done with the previous rotated x
            const int hg = h_lo + (s >> 1);
            const int pairs = min(XS::XH, h_hi - hg) * nrw;
            for (int p0 = 0; p0 < pairs; p0 += 4) {
                float4 xv[4];
                uint2 sv[4];
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int p = p0 + b, hh = p / nrw, r = warp + 4 * (p % nrw);
                    if (p < pairs) {
                        sv[b] = *reinterpret_cast<const uint2*>(su + (hg + hh) * 128 + lane * 4);
                        if (r < R) {
                            const long long xr = xmap ? (long long)xmap[row0 + r] : row0 + r;
                            xv[b] = *reinterpret_cast<const float4*>(x + xr * D + (hg + hh) * 128 + lane * 4);
                        }
                    }
                }
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int p = p0 + b, hh = p / nrw, r = warp + 4 * (p % nrw);
                    if (p < pairs) {
                        uint2 out;
                        out.x = out.y = 0u;
                        if (r < R) {
                            const float s0 = h2f(sv[b].x & 0xFFFF), s1 = h2f(sv[b].x >> 16);
                            const float s2 = h2f(sv[b].y & 0xFFFF), s3 = h2f(sv[b].y >> 16);
                            float v[4] = {fmul(xv[b].x, s0), fmul(xv[b].y, s1), fmul(xv[b].z, s2), fmul(xv[b].w, s3)};
                            wht128(v, lane);
                            out.x = pack_f16(fmul(v[0], HAD_SCALE), fmul(v[1], HAD_SCALE));
                            out.y = pack_f16(fmul(v[2], HAD_SCALE), fmul(v[3], HAD_SCALE));
                        }
                        *reinterpret_cast<uint2*>(xs + r * XS::LD + hh * 128 + lane * 4) = out;
                    }
                }
            }
            __syncthreads();                               // the rotated x is written
        }
        load(s + 1, fill);
        const u32* xst = xlane + ((s >> 1) % XS::XH) * 64 + (s & 1) * (KT_STAGE * 8);
#pragma unroll
        for (int kk = 0; kk < KT_STAGE; ++kk) {
            u32 b[MAXT][2];
#pragma unroll
            for (int i = 0; i < MAXT; ++i) {
                if (i == 0 || i < live) {
                    b[i][0] = xst[i * 4 * XS::LD + kk * 8];
                    b[i][1] = xst[i * 4 * XS::LD + kk * 8 + 4];
                }
            }
#pragma unroll
            for (int nn = 0; nn < 2; ++nn) {
                u32 frag[4];
                if constexpr (DIAG == 1) {
#pragma unroll
                    for (int q = 0; q < 4; ++q) frag[q] = use[kk][nn][q % R_::NWL];
                } else {
                    lane_fragment<K2, CB>(use[kk][nn], a_shift, frag);
                }
#pragma unroll
                for (int i = 0; i < MAXT; ++i)
                    if (i == 0 || i < live) mma(acc[nn][i], frag, b[i][0], b[i][1]);
            }
        }
    };
    load(0, wa);
    if (early) griddep_wait();
    for (int s = 0; s < nst; s += 2) {                     // nst is even (2 stages a 128-row block)
        step(s, wa, wb);
        step(s + 1, wb, wa);
    }
}

// ---- the kernel --------------------------------------------------------------------------------------------------

// Grid (N / 128, S, G * RB), 128 threads. x [G, M, D] fp32; words: the int16 trellis of the stack as u32 words,
// expert e at e * ew; suh [E, D], svh [E, N], bias [E, N] (or null) fp16; ids [G], rows [G] (or null: M); y [G, M, N]
// fp32; part [S, G, M, N]; cnt [G * RB * N / 128] zeros. hpc: 128-row input blocks per split chunk.
// Run mode (xmap [G] given; the routed experts of a round without a host sync): group g is the run of rows[g]
// consecutive positions g, g+1, ... (0 rows: nothing), position q reads x's row xmap[q] (x [*, D]) and writes y's
// row q (y [G, N], part [S, G, N]); M bounds rows[g].
// WR (a variant the bench compares): each warp streams its own two n-tiles through its own quarter of the ring and
// waits for its own copies (cp.async.wait_group + __syncwarp), so the decode loop has no block barrier; the
// barriers are left to the input rotations. RD, DIAG: the bench's other forms (the instantiation macros below).
template <int K2, int CB, int MAXT, bool WR, int DIAG = 0, bool RD = false>
DEVI void exl3_body(const float* __restrict__ x, const u32* __restrict__ words, int ew, const u16* __restrict__ suh,
                    const u16* __restrict__ svh, const u16* __restrict__ bias, const int* __restrict__ ids,
                    const int* __restrict__ rows, const int* __restrict__ xmap, float* __restrict__ y,
                    float* __restrict__ part,
                    int* __restrict__ cnt, int M, int N, int D, int hpc, int S) {
    typedef Rate<K2> R_;
    typedef Ring<K2> RG;
    typedef Xs<MAXT> XS;
    constexpr int RING_BYTES = RG::PF * RG::STAGE;
    constexpr int MAIN = RING_BYTES + XS::BYTES;
    constexpr int SMEM = MAIN > XS::YBYTES ? MAIN : XS::YBYTES;
    __shared__ __align__(16) u8 smem[SMEM];
    __shared__ int last;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g4 = lane >> 2, t4 = lane & 3;
    const int RB = (M + 8 * MAXT - 1) / (8 * MAXT);
    const int grp = blockIdx.z / RB, rb = blockIdx.z % RB;
    // a plain linear (no ids, rows or xmap: nothing that an earlier kernel writes picks its weights) starts
    // streaming its weights before waiting for the previous kernel (a dependent launch); a grouped one waits first
    const bool early = ids == nullptr && rows == nullptr && xmap == nullptr;
    if (!early) griddep_wait();
    const int mv = rows ? min(rows[grp], M) : M;
    const int m0 = rb * 8 * MAXT;
    if (m0 >= mv) return;                                  // every split block of this tile leaves: no arrival
    const int R = min(8 * MAXT, mv - m0);                  // rows of this block
    const int live = (R + 7) >> 3;                         // row tiles with rows
    const long long e = ids ? ids[grp] : 0;
    const u32* wexp = words + e * (long long)ew;
    const u16* su = suh + e * D;
    const int NT = N >> 4;
    const int nt0 = blockIdx.x * (BN / 16);
    const int HB = D >> 7;
    const int h_lo = blockIdx.y * hpc, h_hi = min(HB, h_lo + hpc);
    // (DIAG 2, a bench diagnostic: no stages at all, the launch, the partials and the output rotation only)
    const int nst = DIAG == 2 ? 0 : (h_hi - h_lo) * (128 / 16 / KT_STAGE);
    // rows in the flat row space of x (through xmap in run mode), y and the partials: group grp's row m is
    // grp * M + m, or in run mode (xmap given: a group is a run of consecutive rows) grp + m, x's row xmap[grp + m]
    const long long row0 = xmap ? (long long)grp + m0 : (long long)grp * M + m0;
    const long long TOT = xmap ? (long long)(gridDim.z / RB) : (long long)(gridDim.z / RB) * M;

    const u32 ring = smem_addr(smem);
    u16* xs = reinterpret_cast<u16*>(smem + RING_BYTES);
    // plain C++ reads of the ring and of xs (the compiler schedules them freely; cp_wait and the barriers order them)
    const u32* ring_w = reinterpret_cast<const u32*>(smem);
    const u32* xs_w = reinterpret_cast<const u32*>(smem + RING_BYTES);

    // stage s = k-tiles kt0 .. kt0+3 (kt0 = 8 h_lo + 4 s) of n-tiles nt0 .. nt0+7: 4 runs of 128 K2 bytes (WR: this
    // warp's 2 n-tiles, 4 runs of 32 K2 bytes). A thread's 16-byte chunks sit at the same offsets in every stage:
    // their source offsets (from the stage's first tile) are computed once.
    constexpr int CPT = WR ? 8 * K2 : RG::CHUNKS;          // chunks a stage, of this warp (WR) or of the block
    constexpr int PER_KT = WR ? 2 * K2 : (BN / 16) * K2;   // chunks a k-tile's run
    constexpr int NTH = WR ? 32 : 128;
    constexpr int NCH = (CPT + NTH - 1) / NTH;             // chunks a thread
    const int cid = WR ? lane : threadIdx.x;
    long long soff[NCH];
#pragma unroll
    for (int j = 0; j < NCH; ++j) {
        const int c = cid + NTH * j;
        soff[j] = (long long)(c / PER_KT) * NT * (R_::NW * 4) + (c % PER_KT) * 16;
    }
    const u8* wbase = reinterpret_cast<const u8*>(wexp + (long long)(nt0 + (WR ? 2 * warp : 0)) * R_::NW);
    const u32 dbase = ring + (WR ? warp * (RG::STAGE / 4) : 0) + cid * 16;
    auto issue = [&](int s) {
        if (s < nst) {
            const u8* src = wbase + (long long)(h_lo * 8 + s * KT_STAGE) * NT * (R_::NW * 4);
            const u32 dst = dbase + (s % RG::PF) * RG::STAGE;
#pragma unroll
            for (int j = 0; j < NCH; ++j)
                if (CPT % NTH == 0 || cid + NTH * j < CPT) cp16(dst + NTH * j * 16, src + soff[j]);
        }
        cp_commit();
    };

    // this lane's words of any tile: byte offsets of tile words (i0 + q) mod NW, and the window alignment
    const int st = R_::start(lane);
    const int a_shift = st & 31;
    // (word offsets in a stage of this warp's first tile's words: every other tile of the stage is a compile-time
    // offset from them, and the rotated x's B fragments likewise from one lane base)
    int woff[R_::NWL];
#pragma unroll
    for (int q = 0; q < R_::NWL; ++q) woff[q] = ((st >> 5) + q) % R_::NW + (WR ? 0 : 2 * warp * R_::NW);
    const u32* xlane = xs_w + (g4 * XS::LD + 2 * t4) / 2;

    float acc[2][MAXT][4];
#pragma unroll
    for (int nn = 0; nn < 2; ++nn)
#pragma unroll
        for (int i = 0; i < MAXT; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[nn][i][r] = 0.f;

    const int nrw = (8 * live - warp + 3) >> 2;            // rows r = warp + 4j of this warp (R <= r: zeros)
    if constexpr (RD) {
        exl3_rd_loop<K2, CB, MAXT, DIAG>(acc, wexp, x, su, xmap, xs, xlane, NT, nt0, h_lo, h_hi, nst, nrw, R, live, D,
                                         row0, a_shift, st, early);
    } else {
#pragma unroll
    for (int s = 0; s < RG::PF - 1; ++s) issue(s);
    if (early) griddep_wait();
    for (int s = 0; s < nst; ++s) {
        if ((s & 1) == 0 && (s >> 1) % XS::XH == 0) {
            // the next XH 128-row input blocks: rotate x's columns of them, every row of the block (warps take
            // rows); the loads of 4 (block, row) pairs are in flight together
            __syncthreads();                               // everyone is done with the previous ones
            const int hg = h_lo + (s >> 1);
            const int pairs = min(XS::XH, h_hi - hg) * nrw;
            for (int p0 = 0; p0 < pairs; p0 += 4) {
                float4 xv[4];
                uint2 sv[4];
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int p = p0 + b, hh = p / nrw, r = warp + 4 * (p % nrw);
                    if (p < pairs) {
                        sv[b] = *reinterpret_cast<const uint2*>(su + (hg + hh) * 128 + lane * 4);
                        if (r < R) {
                            const long long xr = xmap ? (long long)xmap[row0 + r] : row0 + r;
                            xv[b] = *reinterpret_cast<const float4*>(x + xr * D + (hg + hh) * 128 + lane * 4);
                        }
                    }
                }
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int p = p0 + b, hh = p / nrw, r = warp + 4 * (p % nrw);
                    if (p < pairs) {
                        uint2 out;
                        out.x = out.y = 0u;
                        if (r < R) {
                            const float s0 = h2f(sv[b].x & 0xFFFF), s1 = h2f(sv[b].x >> 16);
                            const float s2 = h2f(sv[b].y & 0xFFFF), s3 = h2f(sv[b].y >> 16);
                            float v[4] = {fmul(xv[b].x, s0), fmul(xv[b].y, s1), fmul(xv[b].z, s2), fmul(xv[b].w, s3)};
                            wht128(v, lane);
                            out.x = pack_f16(fmul(v[0], HAD_SCALE), fmul(v[1], HAD_SCALE));
                            out.y = pack_f16(fmul(v[2], HAD_SCALE), fmul(v[3], HAD_SCALE));
                        }
                        *reinterpret_cast<uint2*>(xs + r * XS::LD + hh * 128 + lane * 4) = out;
                    }
                }
            }
        }
        if (WR) {
            if ((s & 1) == 0 && (s >> 1) % XS::XH == 0) __syncthreads();    // the rotated x is written
            cp_wait<RG::PF - 2>();                         // this lane's copies of stage s are in
            __syncwarp();                                  // the warp's; its slot (s-1) % PF is free
        } else {
            cp_wait<RG::PF - 2>();                         // this thread's copies of stage s are in
            __syncthreads();                               // everyone's, and the rotated x; slot (s-1) % PF is free
        }
        issue(s + RG::PF - 1);
        const u32* st_base = ring_w + (s % RG::PF) * (RG::STAGE / 4) + (WR ? warp * (RG::STAGE / 16) : 0);
        const u32* wl[R_::NWL];
#pragma unroll
        for (int q = 0; q < R_::NWL; ++q) wl[q] = st_base + woff[q];
        // B fragments: rotated x rows (8i + g4), columns kx + 2t4 (+1) and kx + 2t4 + 8 (+9), kx = this stage's
        // 64 columns + 16 kk
        const u32* xst = xlane + ((s >> 1) % XS::XH) * 64 + (s & 1) * (KT_STAGE * 8);
#pragma unroll
        for (int kk = 0; kk < KT_STAGE; ++kk) {
            u32 b[MAXT][2];
#pragma unroll
            for (int i = 0; i < MAXT; ++i) {
                if (i == 0 || i < live) {                  // a block has at least one row tile
                    b[i][0] = xst[i * 4 * XS::LD + kk * 8];
                    b[i][1] = xst[i * 4 * XS::LD + kk * 8 + 4];
                }
            }
#pragma unroll
            for (int nn = 0; nn < 2; ++nn) {
                const int t_off = (WR ? kk * 2 + nn : kk * (BN / 16) + nn) * R_::NW;   // compile-time
                u32 W[R_::NWL], frag[4];
#pragma unroll
                for (int q = 0; q < R_::NWL; ++q) W[q] = wl[q][t_off];
                if constexpr (DIAG == 1) {                 // bench diagnostic: the words as they are, no decode
#pragma unroll
                    for (int q = 0; q < 4; ++q) frag[q] = W[q % R_::NWL];
                } else {
                    lane_fragment<K2, CB>(W, a_shift, frag);
                }
#pragma unroll
                for (int i = 0; i < MAXT; ++i)
                    if (i == 0 || i < live) mma(acc[nn][i], frag, b[i][0], b[i][1]);
            }
        }
    }
    }
    cp_wait<0>();
    griddep_launch();                                      // the next kernel's blocks may start as this one ends

    // C fragment of n-tile nn, row tile i: (col n = 16(2w+nn) + g4 (+8 for r >= 2), row 8i + 2t4 + (r & 1))
    float* yrows = reinterpret_cast<float*>(smem);
    const int col0 = blockIdx.x * BN;
    if (S > 1) {
        float* p = part + ((long long)blockIdx.y * TOT + row0) * N;
#pragma unroll
        for (int nn = 0; nn < 2; ++nn)
#pragma unroll
            for (int i = 0; i < MAXT; ++i)
                if (i < live) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int m = 8 * i + 2 * t4 + (r & 1), n = col0 + 16 * (2 * warp + nn) + g4 + (r >> 1) * 8;
                        if (m < R) p[(long long)m * N + n] = acc[nn][i][r];
                    }
                }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const int tile = blockIdx.z * gridDim.x + blockIdx.x;
            const int old = atomicAdd(cnt + tile, 1);
            last = old == S - 1;
            if (last) cnt[tile] = 0;                       // every chunk has arrived: ready for the next launch
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        // sum the partials in split order into the shared output rows
        const long long sstride = TOT * N;
        for (int idx = threadIdx.x; idx < R * BN; idx += 128) {
            const int m = idx / BN, n = idx % BN;
            const float* q = part + (row0 + m) * N + col0 + n;
            // 0 + p_0 + p_1 + ... in order; 8 loads in flight at a time (not one L2 latency a partial)
            float sum = 0.f;
            for (int c = 0; c < S; c += 8) {
                float a[8];
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (c + j < S) a[j] = ld_cg(q + (c + j) * sstride);
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (c + j < S) sum = fadd(sum, a[j]);
            }
            yrows[m * XS::YLD + n] = sum;
        }
    } else {
        __syncthreads();                                   // the ring and xs are done: their space holds y's rows
#pragma unroll
        for (int nn = 0; nn < 2; ++nn)
#pragma unroll
            for (int i = 0; i < MAXT; ++i)
                if (i < live) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int m = 8 * i + 2 * t4 + (r & 1), n = 16 * (2 * warp + nn) + g4 + (r >> 1) * 8;
                        if (m < R) yrows[m * XS::YLD + n] = acc[nn][i][r];
                    }
                }
    }
    __syncthreads();
    // output rotation of the block's 128 columns, * svh (+ bias)
    const u16* sv = svh + e * N + col0 + lane * 4;
    const uint2 svv = *reinterpret_cast<const uint2*>(sv);
    const float v0 = h2f(svv.x & 0xFFFF), v1 = h2f(svv.x >> 16), v2 = h2f(svv.y & 0xFFFF), v3 = h2f(svv.y >> 16);
    float b0 = 0.f, b1 = 0.f, b2 = 0.f, b3 = 0.f;
    if (bias) {
        const uint2 bv = *reinterpret_cast<const uint2*>(bias + e * N + col0 + lane * 4);
        b0 = h2f(bv.x & 0xFFFF), b1 = h2f(bv.x >> 16), b2 = h2f(bv.y & 0xFFFF), b3 = h2f(bv.y >> 16);
    }
    for (int m = warp; m < R; m += 4) {
        const float4 u = *reinterpret_cast<const float4*>(yrows + m * XS::YLD + lane * 4);
        float v[4] = {u.x, u.y, u.z, u.w};
        wht128(v, lane);
        float4 o;
        o.x = fmul(fmul(v[0], HAD_SCALE), v0);
        o.y = fmul(fmul(v[1], HAD_SCALE), v1);
        o.z = fmul(fmul(v[2], HAD_SCALE), v2);
        o.w = fmul(fmul(v[3], HAD_SCALE), v3);
        if (bias) {
            o.x = fadd(o.x, b0);
            o.y = fadd(o.y, b1);
            o.z = fadd(o.z, b2);
            o.w = fadd(o.w, b3);
        }
        *reinterpret_cast<float4*>(y + (row0 + m) * N + col0 + lane * 4) = o;
    }
}

#define EXL3_KERNEL_VR(P, WR, DG, RD, LB, K2, CB, T)                                                                \
    extern "C" __global__ void __launch_bounds__ LB P##_k##K2##_cb##CB##_t##T(                                      \
        const float* x, const u32* words, int ew, const u16* suh, const u16* svh, const u16* bias, const int* ids,  \
        const int* rows, const int* xmap, float* y, float* part, int* cnt, int M, int N, int D, int hpc, int S) {   \
        exl3_body<K2, CB, T, WR, DG, RD>(x, words, ew, suh, svh, bias, ids, rows, xmap, y, part, cnt, M, N, D, hpc, \
                                         S);                                                                        \
    }
#define EXL3_KERNEL_VB(P, WR, DG, LB, K2, CB, T) EXL3_KERNEL_VR(P, WR, DG, false, LB, K2, CB, T)
#define EXL3_KERNEL_V(P, WR, K2, CB, T) EXL3_KERNEL_VB(P, WR, 0, (128), K2, CB, T)
#define EXL3_KERNEL(K2, CB, T) EXL3_KERNEL_V(exl3, false, K2, CB, T)
// One row tile (up to 8 rows a block; more rows run in further blocks) for every rate and codebook exllamav3 writes:
// integer K 1..8 with 3INST, MCG and MUL1, and 1.5, 2.5, 3.5 with MUL1. Eight row tiles (up to 64 rows a block: the
// weight decoded once for them) for the rates the published V4.1 packs use (MUL1 at every rate, 4 bits with 3INST
// and MCG); kernels/exl3.py's _T8 lists them (and _T4 the four-tile ones). Fewer instantiations keep the first
// compile short.
#define EXL3_CODEBOOKS(K2) EXL3_KERNEL(K2, 0, 1) EXL3_KERNEL(K2, 1, 1) EXL3_KERNEL(K2, 2, 1) EXL3_KERNEL(K2, 2, 8)
#if !defined(EXL3_BENCH_FORMS)
EXL3_CODEBOOKS(2)
EXL3_CODEBOOKS(4)
EXL3_CODEBOOKS(6)
EXL3_CODEBOOKS(8)
EXL3_CODEBOOKS(10)
EXL3_CODEBOOKS(12)
EXL3_CODEBOOKS(14)
EXL3_CODEBOOKS(16)
EXL3_KERNEL(8, 0, 8) EXL3_KERNEL(8, 1, 8)
// four row tiles (up to 32 rows: fewer registers than eight) at the reference pack's main rates
EXL3_KERNEL(5, 2, 4) EXL3_KERNEL(8, 0, 4) EXL3_KERNEL(8, 2, 4)
EXL3_KERNEL(3, 2, 1) EXL3_KERNEL(3, 2, 8)
EXL3_KERNEL(5, 2, 1) EXL3_KERNEL(5, 2, 8)
EXL3_KERNEL(7, 2, 1) EXL3_KERNEL(7, 2, 8)
// the warp-ring variant at the reference pack's main rates, one row tile (bench comparison)
EXL3_KERNEL_V(exl3w, true, 5, 2, 1) EXL3_KERNEL_V(exl3w, true, 8, 0, 1) EXL3_KERNEL_V(exl3w, true, 8, 2, 1)
#else
// bench-only forms, a module of their own (kernels/exl3.py asks for "exl3.cu#EXL3_BENCH_FORMS": they stay out of
// the served module's first compile; never served). Where the time goes, with wrong values:
// exl3n streams and multiplies the words without decoding them (the warp ring without the codebook arithmetic),
// exl3e runs no stage at all (launch, split partials, reduction, output rotation). Speed: exl3o is the served form
// held to 64 registers (8 blocks a SM instead of 6).
EXL3_KERNEL_VB(exl3n, true, 1, (128), 5, 2, 1) EXL3_KERNEL_VB(exl3n, true, 1, (128), 8, 0, 1)
EXL3_KERNEL_VB(exl3e, true, 2, (128), 5, 2, 1) EXL3_KERNEL_VB(exl3e, true, 2, (128), 8, 0, 1)
EXL3_KERNEL_VB(exl3o, false, 0, (128, 8), 5, 2, 1) EXL3_KERNEL_VB(exl3o, false, 0, (128, 8), 8, 0, 1)
// exl3r: the register-direct form (each warp's words loaded from global memory into registers a stage ahead, no
// shared-memory ring; same arithmetic, so the same bits)
EXL3_KERNEL_VR(exl3r, true, 0, true, (128), 5, 2, 1) EXL3_KERNEL_VR(exl3r, true, 0, true, (128), 8, 0, 1)
#endif  // EXL3_BENCH_FORMS

#endif  // !EXL3_HOST_TEST
