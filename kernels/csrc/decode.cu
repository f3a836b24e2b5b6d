// Decode-round products at the memory-bandwidth floor (issue 24): block-scaled FP8 / bf16 linear and the routed
// FP4 experts, for sm_80+ (mma.sync m16n8k16, bf16 inputs, fp32 accumulation). No headers: NVRTC or nvcc compile
// this file as it is (kernels/cuda.py), and kernels/fp8_linear.py / fp4_moe.py launch it.
//
// Shape of every product: the WEIGHT is the MMA's A operand (16 weight rows per warp), the activation rows are its
// N side in tiles of 8 ("row tiles"); a block of 4 warps covers 64 weight rows and up to 64 activation rows. The
// weight bytes go from global memory straight into registers in the A fragment's order and are unpacked there:
//   FP8 E4M3: sign and exponent/mantissa bits shifted into bf16 positions (value · 2^-120), times one bf16x2 factor
//             2^(scale-7) per 32x32 block (exact: a power of two);
//   FP4 E2M1: each code's three magnitude bits shifted into bf16 exponent/mantissa positions and its sign bit into
//             the sign (value · 2^-126), times one bf16x2 factor 2^(scale-1) per 32-value group (exact; two factors
//             for scale codes above 128).
// Because a lane's logical k positions in the A fragment ({2t, 2t+1, 2t+8, 2t+9} of an MMA, t = lane % 4) may be
// any physical k as long as the activation fragment uses the same ones, each lane reads 16 contiguous bytes of a
// weight row per step, and the activation fragment is gathered in the same order.
//
// Batch invariance by construction: every output element is the same chain of MMAs (same k order, same instruction)
// whatever the number of rows or the row's place; row tiles beyond the rows are skipped whole; K is cut into S
// chunks chosen from the weight's shape only, each chunk summed from zero, the chunks added 0 + p_0 + ... + p_{S-1}
// in order -- by the last of the chunk blocks to finish (an arrival counter) or, for long prompts, by one block.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define DEVI __device__ __forceinline__

DEVI u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

DEVI u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

DEVI void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

DEVI uint4 ldg16(const u8* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

DEVI float4 ldx4(const float* p) {
    float4 r;
    asm("ld.global.nc.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}

DEVI uint2 ldq2(const u32* p) {
    uint2 r;
    asm("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

DEVI uint4 ldq4(const u32* p) {
    uint4 r;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

DEVI float4 ld_cg4(const float* p) {
    float4 r;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}

// Programmatic dependent launch (kernels/pdl.py; fp8_linear launches the linear kernels and pack_x so on sm_90+):
// wait for the stream's previous kernel (its writes visible), then let the next one be scheduled. Before the wait a
// kernel reads only weights; both are no-ops for a plain launch. (exl3.cu has the two steps as two functions: each
// .cu file is compiled alone.)
DEVI void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// 16 bytes global -> shared without a register on the way (cp.async, L2 only); each lane copies and later reads its
// own chunks, so a lane's wait_group is all the synchronisation needed.
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

DEVI uint4 lds16(u32 addr) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
    return r;
}

DEVI u32 word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// ---- activations as bf16 MMA fragments ------------------------------------------------------------------------

// out[m, K/2] (u32 pairs of bf16) = x[m, :K] rounded to bf16, in the order the products read their B fragments:
// mode 0 (FP8 weights): per 4 values (x0, x2), (x1, x3); mode 1 (bf16 weights): (x0, x1), (x2, x3); mode 2 (FP4
// weights): per 8 values (x0, x4), (x2, x6), (x1, x5), (x3, x7). Rows `rows` (or all M when null) give x's row.
// The rounding is the same cvt.rn the kernels apply themselves, so a packed row's products are the same bits.
extern "C" __global__ void __launch_bounds__(256) pack_x(const float* x, int ldx, const int* rows, int topk,
                                                          u32* out, int M, int K, int mode) {
    griddep_wait();
    const int per = mode == 2 ? 8 : 4;
    const long long idx = (long long)blockIdx.x * 256 + threadIdx.x;
    const int groups = K / per;
    if (idx >= (long long)M * groups) return;
    const int m = (int)(idx / groups), gq = (int)(idx % groups);
    const long long src = rows ? (long long)(rows[m] / topk) : m;
    const float* xr = x + src * ldx + (long long)gq * per;
    u32* o = out + (long long)m * (K / 2) + (long long)gq * (per / 2);
    float4 u = ldx4(xr);
    if (mode == 0) {
        o[0] = pack_bf16(u.x, u.z);
        o[1] = pack_bf16(u.y, u.w);
    } else if (mode == 1) {
        o[0] = pack_bf16(u.x, u.y);
        o[1] = pack_bf16(u.z, u.w);
    } else {
        float4 v = ldx4(xr + 4);
        o[0] = pack_bf16(u.x, v.x);
        o[1] = pack_bf16(u.z, v.z);
        o[2] = pack_bf16(u.y, v.y);
        o[3] = pack_bf16(u.w, v.w);
    }
}

// ---- FP8 / bf16 linear ---------------------------------------------------------------------------------------------

// FP8: 4 bytes (k = p..p+3) -> A halves: lo = (byte0, byte2), hi = (byte1, byte3), each bf16 times f2.
DEVI void fp8_pairs(u32 q, u32 f2, u32& lo, u32& hi) {
    hi = hmul2((q & 0x80008000u) | ((q & 0x7F007F00u) >> 4), f2);
    q <<= 8;
    lo = hmul2((q & 0x80008000u) | ((q & 0x7F007F00u) >> 4), f2);
}

// The B fragment of one MMA for activation row pointer xr (nullptr: a row past M -> zeros), physical k base p:
// FP8: b0 = (x[p], x[p+2]), b1 = (x[p+1], x[p+3]); bf16 weights: b0 = (x[p], x[p+1]), b1 = (x[p+2], x[p+3]).
template <bool WFP8>
DEVI void x_frag(const float* xr, int p, u32& b0, u32& b1) {
    if (xr == nullptr) {
        b0 = b1 = 0;
        return;
    }
    float4 v = ldx4(xr + p);
    if (WFP8) {
        b0 = pack_bf16(v.x, v.z);
        b1 = pack_bf16(v.y, v.w);
    } else {
        b0 = pack_bf16(v.x, v.y);
        b1 = pack_bf16(v.z, v.w);
    }
}

// One 16-byte step of a warp: rows ra (= n0 + g) and rb (= n0 + g + 8) of W, lane t's bytes, into acc[8][4]. The
// activation fragments of two words are loaded for every live row tile before their MMAs, so the loads overlap.
template <bool WFP8, int MAXT, bool XB>
DEVI void linear_step(const uint4& wa, const uint4& wb, u32 f2, const float* const* xr, const u32* const* xq,
                      int live, int kbase, float (*acc)[4]) {
    // FP8: 16 values per row per lane -> 4 MMAs (one per 4-byte word); bf16: 8 values -> 2 MMAs (two words each).
    // Packed activations (XB): the fragments of two MMAs are 16 contiguous bytes of the row, loaded at once (half
    // the load instructions, and half the L1 wavefronts: each load of a warp touches 8 rows' lines).
#pragma unroll
    for (int j2 = 0; j2 < (WFP8 ? 4 : 2); j2 += 2) {
        u32 bx[MAXT][4];
#pragma unroll
        for (int i = 0; i < MAXT; ++i)
            if (i < live) {
                if (XB) {
                    if (xq[i] != nullptr) {
                        uint4 v = ldq4(xq[i] + ((kbase + 4 * j2) >> 1));
                        bx[i][0] = v.x;
                        bx[i][1] = v.y;
                        bx[i][2] = v.z;
                        bx[i][3] = v.w;
                    } else {
                        bx[i][0] = bx[i][1] = bx[i][2] = bx[i][3] = 0;
                    }
                } else {
                    x_frag<WFP8>(xr[i], kbase + 4 * j2, bx[i][0], bx[i][1]);
                    x_frag<WFP8>(xr[i], kbase + 4 * j2 + 4, bx[i][2], bx[i][3]);
                }
            }
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            const int j = j2 + jj;
            u32 a0, a1, a2, a3;
            if (WFP8) {
                fp8_pairs(word(wa, j), f2, a0, a2);
                fp8_pairs(word(wb, j), f2, a1, a3);
            } else {
                a0 = word(wa, 2 * j);
                a2 = word(wa, 2 * j + 1);
                a1 = word(wb, 2 * j);
                a3 = word(wb, 2 * j + 1);
            }
#pragma unroll
            for (int i = 0; i < MAXT; ++i)
                if (i < live) mma(acc[i], a0, a1, a2, a3, bx[i][2 * jj], bx[i][2 * jj + 1]);
        }
    }
}

// y[M, N] = bf16(x[M, K]) . W[N, K]^T (fp32 out). Grid (N/64, S or 1, ceil(M/(8 MAXT))), 128 threads; a block
// holds MAXT row tiles of 8 (the launch picks the smallest MAXT for the rows: every tile's MMA chain is the same
// instructions in the same order whatever MAXT, so the choice never changes a bit).
// split (S > 1, few rows): block (nb, c, mb) computes chunk c, stores it to part[c], and the last of the S blocks of
// (nb, mb) adds part[0..S-1] in order into y. Else (S == 1 or IN_PROGRAM) the block runs every chunk in order.
constexpr int PF = 8;                                      // 16-byte weight steps a lane has in flight (a row each)
constexpr int RING_STAGE = 2 * 128 * 16;                   // bytes of one ring stage: rows a and b of 128 lanes

// Several weights that take the same x, concatenated along N (fp8_linear_multi): up to four parts, part i the rows
// [e_{i-1}, e_i) (e_{-1} = 0, e_3 = N; a single weight: e0 = e1 = e2 = N), each with its own split S_i (the split it
// has alone: the same chunks, the same sums, the same bits) and its own output, the [M, e_i - e_{i-1}] block of y at
// M * e_{i-1}. A part starts on a 64-row block; a block past its part's S_i chunks returns at once.
template <bool WFP8, bool IN_PROGRAM, int MAXT, bool XB>
DEVI void linear_body(const float* __restrict__ x, int ldx, const u8* __restrict__ w, const u8* __restrict__ s,
                      float* __restrict__ y, float* __restrict__ part, int* __restrict__ cnt, int M, int N, int K,
                      int kchunk, int S, int xg, int e0, int e1, int e2, int s1, int s2, int s3) {
    const int nb0 = blockIdx.x * 64;
    const int seg = nb0 >= e2 ? 3 : nb0 >= e1 ? 2 : nb0 >= e0 ? 1 : 0;
    const int p_lo = seg == 3 ? e2 : seg == 2 ? e1 : seg == 1 ? e0 : 0;
    const int p_hi = seg == 3 ? N : seg == 2 ? e2 : seg == 1 ? e1 : e0;
    if (seg > 0) {
        S = seg == 3 ? s3 : seg == 2 ? s2 : s1;
        kchunk = K / S;
    }
    if (!IN_PROGRAM && (int)blockIdx.y >= S) return;       // a part with fewer chunks than the launch's most
    float* __restrict__ yp = y + (long long)M * p_lo - p_lo;  // this part's output: row stride ldy, columns from p_lo
    const int ldy = p_hi - p_lo;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = nb0 + warp * 16;
    const int m0 = blockIdx.z * (8 * MAXT);
    const int live = min(MAXT, (M - m0 + 7) >> 3);
    const bool rows_ok = n0 < N;
    const int esz = WFP8 ? 1 : 2;
    const int step = WFP8 ? 64 : 32;                     // k per 16-byte lane step (4 lanes of a row group)
    // XB: x is the packed bf16 buffer of pack_x ([M, K/2] u32, row stride ldx); else float32 rows.
    // xg > 0 (grouped, e.g. wo_a): weight rows [g*xg, (g+1)*xg) multiply x's columns [g*K, (g+1)*K)
    const int xoff = xg > 0 ? (n0 / xg) * K : 0;
    const float* xr[MAXT];
    const u32* xq[MAXT];
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
        int m = m0 + 8 * i + g;
        xr[i] = m < M ? x + (long long)m * ldx + xoff : nullptr;
        xq[i] = m < M ? reinterpret_cast<const u32*>(x) + (long long)m * ldx + (xoff >> 1) : nullptr;
    }
    const u8* wa_row = w + (long long)(rows_ok ? n0 + g : 0) * K * esz;
    const u8* wb_row = wa_row + (long long)8 * K * esz;
    const u8* s_row = s + (long long)((rows_ok ? n0 : 0) >> 5) * (K >> 5);
    __shared__ __align__(16) u8 ring[PF * RING_STAGE];      // [stage][row a | row b][lane] x 16 bytes
    const u32 ring_a = smem_addr(ring) + threadIdx.x * 16, ring_b = ring_a + 128 * 16;
    // IN_PROGRAM: tot = ((0 + p_0) + p_1) + ...; else this block's one chunk, acc (summed from zero by the last block)
    float acc[MAXT][4], tot[IN_PROGRAM ? MAXT : 1][4];
#pragma unroll
    for (int i = 0; i < (IN_PROGRAM ? MAXT : 1); ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) tot[i][r] = 0.f;
    const int c_lo = IN_PROGRAM ? 0 : blockIdx.y, c_hi = IN_PROGRAM ? S : blockIdx.y + 1;
    bool waited = false;                                   // griddep_wait: after the first weight stages are asked
    for (int c = c_lo; c < c_hi; ++c) {
#pragma unroll
        for (int i = 0; i < MAXT; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][r] = 0.f;
        if (rows_ok) {
            // a ring of PF steps of weight bytes in flight ahead of the products, in shared memory (cp.async: no
            // registers held), and their FP8 scale codes in registers
            const int k_beg = c * kchunk, k_end = (c + 1) * kchunk, lk = (step / 4) * t;
            u32 be[PF];
#pragma unroll
            for (int p = 0; p < PF; ++p) {
                const int k = k_beg + p * step;
                if (k < k_end) {
                    cp16(ring_a + p * RING_STAGE, wa_row + (k + lk) * esz);
                    cp16(ring_b + p * RING_STAGE, wb_row + (k + lk) * esz);
                    be[p] = WFP8 ? s_row[(k + 16 * t) >> 5] : 0;
                }
                cp_commit();
            }
            if (!waited) {                                 // x (and every store) only after the previous kernel
                griddep_wait();
                waited = true;
            }
            for (int k0 = k_beg; k0 < k_end; k0 += PF * step) {
#pragma unroll
                for (int p = 0; p < PF; ++p) {
                    const int k = k0 + p * step;
                    if (k < k_end) {
                        cp_wait<PF - 1>();                 // this lane's copies of step k are in
                        const uint4 wa = lds16(ring_a + p * RING_STAGE), wb = lds16(ring_b + p * RING_STAGE);
                        const u32 e = be[p];
                        const int kn = k + PF * step;
                        if (kn < k_end) {
                            cp16(ring_a + p * RING_STAGE, wa_row + (kn + lk) * esz);
                            cp16(ring_b + p * RING_STAGE, wb_row + (kn + lk) * esz);
                            if (WFP8) be[p] = s_row[(kn + 16 * t) >> 5];
                        }
                        cp_commit();
                        u32 f2 = 0;
                        if (WFP8) {
                            const u32 hb = (e + 120u) << 7;    // bf16 of 2^(e-7): the E8M0 factor times 2^120
                            f2 = hb | (hb << 16);
                        }
                        linear_step<WFP8, MAXT, XB>(wa, wb, f2, xr, xq, live, k + lk, acc);
                    }
                }
            }
            cp_wait<0>();
        }
        if (IN_PROGRAM) {
#pragma unroll
            for (int i = 0; i < MAXT; ++i)
#pragma unroll
                for (int r = 0; r < 4; ++r) tot[IN_PROGRAM ? i : 0][r] = tot[IN_PROGRAM ? i : 0][r] + acc[i][r];
        }
    }
    if (!waited) griddep_wait();                           // a block without weight rows: before its stores
    // C fragment of row tile i: (n0 + g, m0 + 8i + 2t), (.., +1), (n0 + g + 8, ..), (.., +1)
    // (a part of one chunk in a split launch: 0 + its sum, as the in-program form adds it: -0 becomes +0 alike)
    const bool split = S > 1 && !IN_PROGRAM;
    float* dst = split ? part + (long long)blockIdx.y * M * N : yp;
    const long long ldd = split ? N : ldy;
    if (rows_ok) {
#pragma unroll
        for (int i = 0; i < MAXT; ++i) {
            if (i < live) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    int n = n0 + g + (r >> 1) * 8, m = m0 + 8 * i + 2 * t + (r & 1);
                    if (m < M && n < p_hi)
                        dst[(long long)m * ldd + n] = IN_PROGRAM ? tot[IN_PROGRAM ? i : 0][r]
                                                      : split ? acc[i][r] : 0.f + acc[i][r];
                }
            }
        }
    }
    if (!split) return;
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int tile = blockIdx.z * gridDim.x + blockIdx.x;
        int old = atomicAdd(cnt + tile, 1);
        last = old == S - 1;
        if (last) cnt[tile] = 0;                           // every chunk has arrived: ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The tile's sums, each 0 + p_0 + ... + p_{S-1} in chunk order whichever thread adds it (the same bits): a
    // thread takes four adjacent columns of each of its rows (16-byte loads) and asks for RB chunks' partials of
    // every one of its rows at once before adding them. They come from L2 and one block adds the whole tile, so
    // the loads it keeps in flight bound it: a tail that waited for each load before asking for the next was S
    // round trips long, most of a wide-split launch's time at one row (K cut in 16-40 chunks so the weight fills
    // the SMs), and one that took its rows one after the other paid that per row at 32 rows (the partials grow
    // with the rows: 40 chunks x 32 rows x 64 columns are 320 KB for one block). 16 loads in flight a thread (8
    // before); at four row tiles 12 (FP8) and 8 (bf16): what each variant holds in registers without spilling
    // (ptxas -v, sm_90).
    constexpr int RB = MAXT == 4 ? (WFP8 ? 3 : 2) : 16 / MAXT;
    const int n = nb0 + 4 * (threadIdx.x & 15);            // columns n..n+3 (parts end on multiples of 16)
    if (n >= p_hi) return;
    const int m_end = min(M, m0 + 8 * live);
    const long long cstride = (long long)M * N;
    const int mt = m0 + (threadIdx.x >> 4);                // this thread's rows: mt, mt + 8, ... (one a row tile)
    float4 sum[MAXT];
#pragma unroll
    for (int i = 0; i < MAXT; ++i) sum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c0 = 0; c0 < S; c0 += RB) {
        float4 v[MAXT][RB];
#pragma unroll
        for (int i = 0; i < MAXT; ++i) {
            const float* src = part + (long long)(mt + 8 * i) * N + n;
#pragma unroll
            for (int j = 0; j < RB; ++j)
                v[i][j] = mt + 8 * i < m_end && c0 + j < S ? ld_cg4(src + (c0 + j) * cstride)
                                                          : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < MAXT; ++i) {
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                if (c0 + j < S) {
                    sum[i].x = sum[i].x + v[i][j].x;
                    sum[i].y = sum[i].y + v[i][j].y;
                    sum[i].z = sum[i].z + v[i][j].z;
                    sum[i].w = sum[i].w + v[i][j].w;
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
        if (mt + 8 * i < m_end) {
            float* o = yp + (long long)(mt + 8 * i) * ldy + n;
            o[0] = sum[i].x;
            o[1] = sum[i].y;
            o[2] = sum[i].z;
            o[3] = sum[i].w;
        }
    }
}

// one row tile reads float32 x itself; more read the packed bf16 fragments of pack_x (the same rounding)
#define LINEAR_KERNEL(name, WFP8, IN_PROGRAM, MAXT)                                                          \
    extern "C" __global__ void __launch_bounds__(128) name(const float* x, int ldx, const u8* w, const u8* s,     \
                                                           float* y, float* part, int* cnt, int M, int N, int K,  \
                                                           int kchunk, int S, int xg, int e0, int e1, int e2,     \
                                                           int s1, int s2, int s3) {                              \
        linear_body<WFP8, IN_PROGRAM, MAXT, (MAXT > 1)>(x, ldx, w, s, y, part, cnt, M, N, K, kchunk, S, xg, e0, e1,  \
                                                        e2, s1, s2, s3);                                             \
    }
#define LINEAR_KERNELS(T)                                   \
    LINEAR_KERNEL(fp8_linear_split_t##T, true, false, T)    \
    LINEAR_KERNEL(fp8_linear_whole_t##T, true, true, T)     \
    LINEAR_KERNEL(bf16_linear_split_t##T, false, false, T)  \
    LINEAR_KERNEL(bf16_linear_whole_t##T, false, true, T)
LINEAR_KERNELS(1)
LINEAR_KERNELS(2)
LINEAR_KERNELS(4)
LINEAR_KERNELS(8)

// ---- FP4 routed experts ------------------------------------------------------------------------------------------

// bf16x2 factors of an E8M0 scale code e (0..254): f = 2^(min(e, 128) - 1), g = 2^(e - 128) (1 when e <= 128).
DEVI u32 e2m1_factor(u32 e) {
    const u32 hb = ((e > 128u ? 128u : e) + 126u) << 7;
    return hb | (hb << 16);
}

DEVI u32 e2m1_extra(u32 e) {
    const u32 hb = (e > 128u ? e - 1u : 127u) << 7;
    return hb | (hb << 16);
}

// E2M1 code c = (sign, e1, e0, m) to bf16 without a table: the three magnitude bits moved to bf16 bits 8..6 (the
// exponent's two low bits and the mantissa's top bit) and the sign to bit 15 give, read as bf16, 2^(e-127) (1 + m/2)
// for e > 0 and the subnormal 2^-127 for (e, m) = (0, 1): the E2M1 value times 2^-126 in every case (0 stays 0). One
// bf16x2 multiply by 2^(s-1) then gives value · 2^(s-127), exactly (powers of two; a subnormal result is exact too).
// 2^(s-1) is a bf16 for s <= 128 (any trained weight: |w| <= 12); a warp with a larger code in its step multiplies
// once more, by 2^(s-128) (exact as well).
// 4 packed bytes (8 codes: nibble n = byte n/2, high nibble when n odd) -> four bf16 pairs
// P0 = (n0, n4), P1 = (n2, n6), P2 = (n1, n5), P3 = (n3, n7), each times the bf16x2 factor f2 (and, when big, the
// second factor of e).
DEVI void e2m1_pairs(u32 q, u32 f2, u32 e, bool big, u32& P0, u32& P1, u32& P2, u32& P3) {
    P0 = hmul2(((q << 6) & 0x01C001C0u) | ((q << 12) & 0x80008000u), f2);
    P1 = hmul2(((q >> 2) & 0x01C001C0u) | ((q << 4) & 0x80008000u), f2);
    P2 = hmul2(((q << 2) & 0x01C001C0u) | ((q << 8) & 0x80008000u), f2);
    P3 = hmul2(((q >> 6) & 0x01C001C0u) | (q & 0x80008000u), f2);
    if (big) {
        const u32 g2 = e2m1_extra(e);
        P0 = hmul2(P0, g2);
        P1 = hmul2(P1, g2);
        P2 = hmul2(P2, g2);
        P3 = hmul2(P3, g2);
    }
}

// B fragments of the two MMAs of a 4-byte word at value index base: MMA 2j: b0 = (x[b], x[b+4]), b1 = (x[b+2],
// x[b+6]); MMA 2j+1: b0 = (x[b+1], x[b+5]), b1 = (x[b+3], x[b+7]).
// (from the packed bf16 rows of pack_x mode 2, or the up kernel's h: 16 bytes, no conversion)
DEVI void e2m1_x(const u32* xr, int base, u32& b00, u32& b01, u32& b10, u32& b11) {
    if (xr == nullptr) {
        b00 = b01 = b10 = b11 = 0;
        return;
    }
    uint4 v = ldq4(xr + (base >> 1));
    b00 = v.x;
    b01 = v.y;
    b10 = v.z;
    b11 = v.w;
}

struct Tile {
    int cnt, e, p0;
};

DEVI Tile load_tile(const int* tile_e, const int* tile_start, const int* tile_cnt) {
    Tile tl;
    tl.cnt = tile_cnt[blockIdx.x];
    tl.e = tile_e[blockIdx.x];
    tl.p0 = tile_start[blockIdx.x];
    return tl;
}

// One step of NMAT weight matrices (rows g and g+8 of each: 16 bytes a row) against the same activation rows:
// per 4-byte word, the activation fragments of every live row tile once, then 2 MMAs per matrix and tile.
template <int NMAT, int MAXT>
DEVI void e2m1_step(const uint4* qa, const uint4* qb, const u32* ea, const u32* eb, const u32* const* xr, int live,
                    int vbase, float (*acc)[MAXT][4]) {
    u32 fa[NMAT], fb[NMAT], emax = 0;
#pragma unroll
    for (int mt = 0; mt < NMAT; ++mt) {
        fa[mt] = e2m1_factor(ea[mt]);
        fb[mt] = e2m1_factor(eb[mt]);
        emax = max(emax, max(ea[mt], eb[mt]));
    }
    const bool big = __any_sync(0xffffffffu, emax > 128u);     // warp-uniform: no divergence
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 bx[MAXT][4];
#pragma unroll
        for (int i = 0; i < MAXT; ++i)
            if (i < live) e2m1_x(xr[i], vbase + 8 * j, bx[i][0], bx[i][1], bx[i][2], bx[i][3]);
#pragma unroll
        for (int mt = 0; mt < NMAT; ++mt) {
            u32 A0, A1, A2, A3, B0, B1, B2, B3;
            e2m1_pairs(word(qa[mt], j), fa[mt], ea[mt], big, A0, A1, A2, A3);
            e2m1_pairs(word(qb[mt], j), fb[mt], eb[mt], big, B0, B1, B2, B3);
#pragma unroll
            for (int i = 0; i < MAXT; ++i) {
                if (i < live) {
                    mma(acc[mt][i], A0, B0, A1, B1, bx[i][0], bx[i][1]);   // logical slots: (n0, n4 | n2, n6)
                    mma(acc[mt][i], A2, B2, A3, B3, bx[i][2], bx[i][3]);   // (n1, n5 | n3, n7)
                }
            }
        }
    }
}

// The K loop of NMAT weight matrices' rows (g, g+8) (pointers wa[mt], wb[mt], scale rows sa[mt], sb[mt]) over
// nbytes packed bytes: a ring of PFM steps of bytes in shared memory (cp.async) and their scale codes in registers,
// in flight ahead of the products.
template <int NMAT>
struct MoeRing {
    static constexpr int PFM = NMAT == 2 ? 3 : 6;
    static constexpr int STAGE = NMAT * 2 * 128 * 16;     // [mt][row a | row b][lane] x 16 bytes
};

template <int NMAT, int MAXT>
DEVI void e2m1_loop(const u8* const* wa, const u8* const* wb, const u8* const* sa, const u8* const* sb, int nbytes,
                    int t, const u32* const* xr, int live, float (*acc)[MAXT][4]) {
    constexpr int PFM = MoeRing<NMAT>::PFM, STAGE = MoeRing<NMAT>::STAGE;
    __shared__ __align__(16) u8 ring[PFM * STAGE];
    const u32 base = smem_addr(ring) + threadIdx.x * 16;
    const int off = 16 * t;
    u32 ea[PFM][NMAT], eb[PFM][NMAT];
#pragma unroll
    for (int p = 0; p < PFM; ++p) {
        const int o = p * 64 + off;
        if (p * 64 < nbytes) {
#pragma unroll
            for (int mt = 0; mt < NMAT; ++mt) {
                cp16(base + p * STAGE + (2 * mt) * 2048, wa[mt] + o);
                cp16(base + p * STAGE + (2 * mt + 1) * 2048, wb[mt] + o);
                ea[p][mt] = sa[mt][o >> 4];
                eb[p][mt] = sb[mt][o >> 4];
            }
        }
        cp_commit();
    }
    for (int b0 = 0; b0 < nbytes; b0 += PFM * 64) {
#pragma unroll
        for (int p = 0; p < PFM; ++p) {
            const int b = b0 + p * 64;
            if (b < nbytes) {
                cp_wait<PFM - 1>();                        // this lane's copies of step b are in
                uint4 ca[NMAT], cb[NMAT];
                u32 fa[NMAT], fb[NMAT];
#pragma unroll
                for (int mt = 0; mt < NMAT; ++mt) {
                    ca[mt] = lds16(base + p * STAGE + (2 * mt) * 2048);
                    cb[mt] = lds16(base + p * STAGE + (2 * mt + 1) * 2048);
                    fa[mt] = ea[p][mt];
                    fb[mt] = eb[p][mt];
                }
                const int bn = b + PFM * 64;
                if (bn < nbytes) {
                    const int o = bn + off;
#pragma unroll
                    for (int mt = 0; mt < NMAT; ++mt) {
                        cp16(base + p * STAGE + (2 * mt) * 2048, wa[mt] + o);
                        cp16(base + p * STAGE + (2 * mt + 1) * 2048, wb[mt] + o);
                        ea[p][mt] = sa[mt][o >> 4];
                        eb[p][mt] = sb[mt][o >> 4];
                    }
                }
                cp_commit();
                // a lane's 16 bytes are one 32-value scale group
                e2m1_step<NMAT, MAXT>(ca, cb, fa, fb, xr, live, 2 * (b + off), acc);
            }
        }
    }
    cp_wait<0>();
}

// Gate/up: grid (work-list tiles, I/64), 128 threads; a tile's pairs in chunks of MAXT row tiles of 8 (a decode
// round launches MAXT 1: its tiles hold a pair or two and the registers then allow more blocks; a prompt chunk the
// fewest that hold a tile: every pair's MMA chain is the same whatever MAXT and the chunking).
// h[place, I] = silu(min(x.w1, limit)) * clamp(x.w3, +-limit) * rw.
template <int MAXT>
DEVI void moe_up_body(const u32* x, const u8* w13, const u8* s13, const int* tile_e, const int* tile_start,
                      const int* tile_cnt, const int* order, const float* rw, unsigned short* h, int H, int I, int topk,
                      float limit) {
    Tile tl = load_tile(tile_e, tile_start, tile_cnt);
    if (tl.cnt == 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.y * 64 + warp * 16;          // intermediate rows of this warp
    const int HB = H >> 1;
    const long long e = tl.e;
    const u8* w1a = w13 + ((e * 2 * I) + r0 + g) * HB;
    const u8* s1a = s13 + ((e * 2 * I) + r0 + g) * (H >> 5);
    const u8* wa[2] = {w1a, w1a + (long long)I * HB};
    const u8* wb[2] = {w1a + 8LL * HB, w1a + (long long)(I + 8) * HB};
    const u8* sa[2] = {s1a, s1a + (long long)I * (H >> 5)};
    const u8* sb[2] = {s1a + 8LL * (H >> 5), s1a + (long long)(I + 8) * (H >> 5)};
    // the tile's pairs in chunks of 8 MAXT (a decode round's tiles hold one or two: the weights stream once)
#pragma unroll 1
    for (int c0 = 0; c0 < tl.cnt; c0 += 8 * MAXT) {
    const int cnt = min(8 * MAXT, tl.cnt - c0), p0 = tl.p0 + c0;
    const int live = (cnt + 7) >> 3;
    const u32* xr[MAXT];                                  // packed bf16 rows of x (pack_x mode 2): H/2 words each
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
        int q = 8 * i + g;
        xr[i] = q < cnt ? x + (long long)(order[p0 + q] / topk) * (H >> 1) : nullptr;
    }
    float acc[2][MAXT][4];                               // gate (w1), up (w3)
#pragma unroll
    for (int i = 0; i < MAXT; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[0][i][r] = acc[1][i][r] = 0.f;
    e2m1_loop<2, MAXT>(wa, wb, sa, sb, HB, t, xr, live, acc);
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
        if (i < live) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                int q = 8 * i + 2 * t + (r & 1);
                if (q < cnt) {
                    int row = r0 + g + (r >> 1) * 8;
                    float gt = fminf(acc[0][i][r], limit);
                    float up = fminf(fmaxf(acc[1][i][r], -limit), limit);
                    float wgt = rw[order[p0 + q]];
                    // h rounded to bf16 (as the down product reads it), stored in pack_x mode 2's order
                    float hv = gt / (1.0f + expf(-gt)) * up * wgt;
                    unsigned short hb;
                    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(hb) : "f"(hv));
                    const int r8 = row & 7;              // its place in the group: r8's three bits reversed
                    const int pos = (row & ~7) | ((r8 & 1) << 2) | (r8 & 2) | (r8 >> 2);
                    h[(long long)(p0 + q) * I + pos] = hb;
                }
            }
        }
    }
    }
}

// Down: grid (work-list tiles, H/64), 128 threads. y[pair, H] = h[place] . w2^T.
template <int MAXT>
DEVI void moe_down_body(const u32* h, const u8* w2, const u8* s2, const int* tile_e, const int* tile_start,
                        const int* tile_cnt, const int* order, float* y, int H, int I) {
    Tile tl = load_tile(tile_e, tile_start, tile_cnt);
    if (tl.cnt == 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.y * 64 + warp * 16;
    const int IB = I >> 1;
    const long long e = tl.e;
    const u8* wa[1] = {w2 + (e * H + r0 + g) * IB};
    const u8* wb[1] = {wa[0] + 8LL * IB};
    const u8* sa[1] = {s2 + (e * H + r0 + g) * (I >> 5)};
    const u8* sb[1] = {sa[0] + 8LL * (I >> 5)};
#pragma unroll 1
    for (int c0 = 0; c0 < tl.cnt; c0 += 8 * MAXT) {     // the tile's pairs in chunks of 8 MAXT, as the up kernel
    const int cnt = min(8 * MAXT, tl.cnt - c0), p0 = tl.p0 + c0;
    const int live = (cnt + 7) >> 3;
    const u32* hr[MAXT];                                  // the up kernel's packed bf16 h: I/2 words a pair
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
        int q = 8 * i + g;
        hr[i] = q < cnt ? h + (long long)(p0 + q) * (I >> 1) : nullptr;
    }
    float acc[1][MAXT][4];
#pragma unroll
    for (int i = 0; i < MAXT; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[0][i][r] = 0.f;
    e2m1_loop<1, MAXT>(wa, wb, sa, sb, IB, t, hr, live, acc);
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
        if (i < live) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                int q = 8 * i + 2 * t + (r & 1);
                if (q < cnt) y[(long long)order[p0 + q] * H + r0 + g + (r >> 1) * 8] = acc[0][i][r];
            }
        }
    }
    }
}

#define MOE_KERNELS(T)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128, T <= 2 ? 5 : 1) moe_up_t##T(                                               \
        const u32* x, const u8* w13, const u8* s13, const int* tile_e, const int* tile_start,                    \
        const int* tile_cnt, const int* order, const float* rw, unsigned short* h, int H, int I, int topk,        \
        float limit) {                                                                                          \
        moe_up_body<T>(x, w13, s13, tile_e, tile_start, tile_cnt, order, rw, h, H, I, topk, limit);             \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, T <= 2 ? 5 : 1) moe_down_t##T(                                             \
        const u32* h, const u8* w2, const u8* s2, const int* tile_e, const int* tile_start,                      \
        const int* tile_cnt, const int* order, float* y, int H, int I) {                                         \
        moe_down_body<T>(h, w2, s2, tile_e, tile_start, tile_cnt, order, y, H, I);                               \
    }
MOE_KERNELS(1)
MOE_KERNELS(2)
MOE_KERNELS(4)
MOE_KERNELS(8)

// ---- the decode form: one row tile, lean inner loop ------------------------------------------------------------
//
// A decode round's tiles hold one or two pairs, so each weight byte is decoded for one row tile of 8 and the kernels
// are bound by the integer pipe, not by DRAM (ncu, session 9: moe_up_t1 SM 72 % / DRAM 38 %). This form keeps every
// pair's MMA chain of moe_*_t1 (same lanes' bytes, same fragments, same k order: the same bits, tested against the
// prompt forms) and cuts what surrounds the E2M1 unpacking:
//   - NW warps a block (2: twice the blocks of the t forms, so 6 experts at one row still spread over every SM);
//   - a ring of PF steps of weight bytes (cp.async) with its scale codes, stepped by pointers advanced once per PF
//     steps (immediate offsets inside), no per-step bounds other than the prefetch predicate;
//   - the bf16x2 factor 2^(e-1) from one integer multiply-add of the code (e <= 128), the rare larger code on a
//     warp-uniform second path;
//   - rows past the chunk's pairs read a live pair's x (their MMA columns are never stored; a column of an MMA
//     depends only on its own B column), so no null checks in the loop.
template <int NMAT>
struct LeanRing {
    static constexpr int PF = NMAT == 2 ? 4 : 8;          // 16-byte steps a lane has in flight per row stream
};

DEVI u32 lean_factor(u32 e) { return e * 0x00800080u + 0x3F003F00u; }   // bf16x2 2^(e-1), e <= 128

// One 64-byte step of the lean loop: the NMAT matrices' rows (g, g + 8) against one row tile. BIG: a scale code
// above 128 in the warp (two factors; never for trained weights), a separate straight-line path.
// XF: xs is float32 x (the pair's row as it is: the fragments rounded here, the same cvt.rn as pack_x mode 2), so a
// round of a few rows needs no pack_x launch; else the packed bf16 row.
template <int NMAT, bool BIG, bool XF>
DEVI void lean_step(const uint4* q, const u32* e, const u32* xs, float (*acc)[4]) {
    u32 f[2 * NMAT];
#pragma unroll
    for (int k = 0; k < 2 * NMAT; ++k) f[k] = BIG ? e2m1_factor(e[k]) : lean_factor(e[k]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        uint4 v;
        if (XF) {
            const float* xf = reinterpret_cast<const float*>(xs) + 8 * j;
            const float4 u = ldx4(xf), w = ldx4(xf + 4);
            v.x = pack_bf16(u.x, w.x);
            v.y = pack_bf16(u.z, w.z);
            v.z = pack_bf16(u.y, w.y);
            v.w = pack_bf16(u.w, w.w);
        } else {
            v = ldq4(xs + 4 * j);
        }
#pragma unroll
        for (int mt = 0; mt < NMAT; ++mt) {
            u32 A0, A1, A2, A3, B0, B1, B2, B3;
            e2m1_pairs(word(q[2 * mt], j), f[2 * mt], e[2 * mt], BIG, A0, A1, A2, A3);
            e2m1_pairs(word(q[2 * mt + 1], j), f[2 * mt + 1], e[2 * mt + 1], BIG, B0, B1, B2, B3);
            mma(acc[mt], A0, B0, A1, B1, v.x, v.y);
            mma(acc[mt], A2, B2, A3, B3, v.z, v.w);
        }
    }
}

template <int NMAT, int NW, bool XF>
DEVI void lean_loop(const u8* const* w, const u8* const* sc, int nsteps, const u32* xr, float (*acc)[4]) {
    constexpr int PF = LeanRing<NMAT>::PF, NS = 2 * NMAT, LANES = 32 * NW;
    constexpr int STAGE = NS * LANES * 16;
    __shared__ __align__(16) u8 ring[PF * STAGE];
    const u32 base = smem_addr(ring) + threadIdx.x * 16;
    const u8* pw[NS];
    const u8* ps[NS];
#pragma unroll
    for (int k = 0; k < NS; ++k) {
        pw[k] = w[k];
        ps[k] = sc[k];
    }
    u32 ec[PF][NS];
#pragma unroll
    for (int p = 0; p < PF; ++p) {
        if (p < nsteps) {
#pragma unroll
            for (int k = 0; k < NS; ++k) {
                cp16(base + p * STAGE + k * LANES * 16, pw[k] + 64 * p);
                ec[p][k] = ps[k][4 * p];
            }
        }
        cp_commit();
    }
    const u32* xq = xr;
#pragma unroll 1
    for (int s0 = 0; s0 < nsteps; s0 += PF) {
#pragma unroll
        for (int p = 0; p < PF; ++p) {
            if (s0 + p < nsteps) {
                cp_wait<PF - 1>();
                uint4 q[NS];
                u32 e[NS];
                u32 emax = 0;
#pragma unroll
                for (int k = 0; k < NS; ++k) {
                    q[k] = lds16(base + p * STAGE + k * LANES * 16);
                    e[k] = ec[p][k];
                    emax = max(emax, e[k]);
                }
                if (s0 + p + PF < nsteps) {
#pragma unroll
                    for (int k = 0; k < NS; ++k) {
                        cp16(base + p * STAGE + k * LANES * 16, pw[k] + 64 * (p + PF));
                        ec[p][k] = ps[k][4 * (p + PF)];
                    }
                }
                cp_commit();
                const u32* xs = xq + 64 * p * (XF ? 2 : 1);
                if (__any_sync(0xffffffffu, emax > 128u)) lean_step<NMAT, true, XF>(q, e, xs, acc);
                else lean_step<NMAT, false, XF>(q, e, xs, acc);
            }
        }
#pragma unroll
        for (int k = 0; k < NS; ++k) {
            pw[k] += 64 * PF;
            ps[k] += 4 * PF;
        }
        xq += 64 * PF * (XF ? 2 : 1);
    }
    cp_wait<0>();
}

// Gate/up, decode form: grid (work-list tiles, I / (16 NW)), 32 NW threads; the tile's pairs in chunks of 8.
template <int NW, bool XF>
DEVI void moe_up_lean_body(const u32* x, const u8* w13, const u8* s13, const int* tile_e, const int* tile_start,
                           const int* tile_cnt, const int* order, const float* rw, unsigned short* h, int H, int I,
                           int topk, float limit) {
    Tile tl = load_tile(tile_e, tile_start, tile_cnt);
    if (tl.cnt == 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.y * (16 * NW) + warp * 16;
    const int HB = H >> 1, HS = H >> 5;
    const long long row = (long long)tl.e * 2 * I + r0 + g;
    const u8* w1a = w13 + row * HB + 16 * t;
    const u8* s1a = s13 + row * HS + t;
    const u8* w[4] = {w1a, w1a + 8LL * HB, w1a + (long long)I * HB, w1a + (long long)(I + 8) * HB};
    const u8* sc[4] = {s1a, s1a + 8LL * HS, s1a + (long long)I * HS, s1a + (long long)(I + 8) * HS};
#pragma unroll 1
    for (int c0 = 0; c0 < tl.cnt; c0 += 8) {
        const int cnt = min(8, tl.cnt - c0), p0 = tl.p0 + c0;
        const long long xrow = order[p0 + min(g, cnt - 1)] / topk;      // XF: float32 rows of H, else H/2 words
        const u32* xr = x + (XF ? xrow * H + 32 * t : xrow * (H >> 1) + 16 * t);
        float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        lean_loop<2, NW, XF>(w, sc, HB >> 6, xr, acc);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int q = 2 * t + (r & 1);
            if (q < cnt) {
                const int rr = r0 + g + (r >> 1) * 8;
                float gt = fminf(acc[0][r], limit);
                float up = fminf(fmaxf(acc[1][r], -limit), limit);
                float wgt = rw[order[p0 + q]];
                float hv = gt / (1.0f + expf(-gt)) * up * wgt;    // as moe_up_body: the same h bits
                unsigned short hb;
                asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(hb) : "f"(hv));
                const int r8 = rr & 7;
                const int pos = (rr & ~7) | ((r8 & 1) << 2) | (r8 & 2) | (r8 >> 2);
                h[(long long)(p0 + q) * I + pos] = hb;
            }
        }
    }
}

// Down, decode form: grid (work-list tiles, H / (16 NW)), 32 NW threads.
template <int NW>
DEVI void moe_down_lean_body(const u32* h, const u8* w2, const u8* s2, const int* tile_e, const int* tile_start,
                             const int* tile_cnt, const int* order, float* y, int H, int I) {
    Tile tl = load_tile(tile_e, tile_start, tile_cnt);
    if (tl.cnt == 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.y * (16 * NW) + warp * 16;
    const int IB = I >> 1, IS = I >> 5;
    const long long row = (long long)tl.e * H + r0 + g;
    const u8* wa = w2 + row * IB + 16 * t;
    const u8* sa = s2 + row * IS + t;
    const u8* w[2] = {wa, wa + 8LL * IB};
    const u8* sc[2] = {sa, sa + 8LL * IS};
#pragma unroll 1
    for (int c0 = 0; c0 < tl.cnt; c0 += 8) {
        const int cnt = min(8, tl.cnt - c0), p0 = tl.p0 + c0;
        const u32* hr = h + (long long)(p0 + min(g, cnt - 1)) * (I >> 1) + 16 * t;
        float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
        lean_loop<1, NW, false>(w, sc, IB >> 6, hr, acc);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int q = 2 * t + (r & 1);
            if (q < cnt) y[(long long)order[p0 + q] * H + r0 + g + (r >> 1) * 8] = acc[0][r];
        }
    }
}

#define MOE_LEAN_KERNELS(NW)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * NW) moe_up_lean_w##NW(                                     \
        const u32* x, const u8* w13, const u8* s13, const int* tile_e, const int* tile_start, const int* tile_cnt, \
        const int* order, const float* rw, unsigned short* h, int H, int I, int topk, float limit) {            \
        moe_up_lean_body<NW, false>(x, w13, s13, tile_e, tile_start, tile_cnt, order, rw, h, H, I, topk, limit); \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NW) moe_up_lean_x_w##NW(                                   \
        const u32* x, const u8* w13, const u8* s13, const int* tile_e, const int* tile_start, const int* tile_cnt, \
        const int* order, const float* rw, unsigned short* h, int H, int I, int topk, float limit) {            \
        moe_up_lean_body<NW, true>(x, w13, s13, tile_e, tile_start, tile_cnt, order, rw, h, H, I, topk, limit);  \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * NW) moe_down_lean_w##NW(                                   \
        const u32* h, const u8* w2, const u8* s2, const int* tile_e, const int* tile_start, const int* tile_cnt,  \
        const int* order, float* y, int H, int I) {                                                             \
        moe_down_lean_body<NW>(h, w2, s2, tile_e, tile_start, tile_cnt, order, y, H, I);                        \
    }
MOE_LEAN_KERNELS(1)
MOE_LEAN_KERNELS(2)
MOE_LEAN_KERNELS(4)

// ---- the routed experts' work list for a decode round ---------------------------------------------------------------

// Inclusive sum of v over the block's threads (blockDim.x a multiple of 32, at most 1024).
DEVI int block_scan(int v, int* warp_sums) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int w = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int u = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += u;
        }
        warp_sums[lane] = w;
    }
    __syncthreads();
    return v + (warp > 0 ? warp_sums[warp - 1] : 0);
}

// fp4_moe.py's `work_list` (the same four arrays, bit for bit) in one block, for up to 1024 (row, slot) pairs and
// 1023 experts: keys (id, or E for another rank's slot) counted with shared atomics, scanned, each pair placed by its
// rank among the earlier pairs of its key (stable), then the tiles of up to 64 pairs of each expert.
extern "C" __global__ void __launch_bounds__(1024) work_list_small(const int* ids, int P, int E, int n_tiles,
                                                                    int* order, int* tile_e, int* tile_start,
                                                                    int* tile_cnt) {
    __shared__ int key[1024], cnt[1024], start[1024], tend[1024], warp_sums[32];
    const int tid = threadIdx.x;
    cnt[tid] = 0;
    if (tid < P) {
        int k = ids[tid];
        key[tid] = k >= 0 ? k : E;
    }
    __syncthreads();
    if (tid < P) atomicAdd(cnt + key[tid], 1);
    __syncthreads();
    const int c = tid <= E ? cnt[tid] : 0;
    const int tiles = tid < E ? (c + 63) >> 6 : 0;
    const int ic = block_scan(c, warp_sums);
    __syncthreads();
    const int it = block_scan(tiles, warp_sums);
    start[tid] = ic - c;
    tend[tid] = it;
    __syncthreads();
    if (tid < P) {
        const int k = key[tid];
        int rank = 0;
        for (int q = 0; q < tid; ++q) rank += key[q] == k;
        order[start[k] + rank] = tid;
    }
    for (int t = tid; t < n_tiles; t += blockDim.x) {
        int lo = 0, hi = E;                                // searchsorted(tend[:E], t, right=True)
        while (lo < hi) {
            int mid = (lo + hi) >> 1;
            if (tend[mid] <= t) lo = mid + 1; else hi = mid;
        }
        const bool live = lo < E;
        const int e = live ? lo : E - 1;
        const int te = (cnt[e] + 63) >> 6;
        const int off = (t - (tend[e] - te)) * 64;
        int n = cnt[e] - off;
        n = n < 0 ? 0 : n > 64 ? 64 : n;
        tile_e[t] = e;
        tile_start[t] = start[e] + off;
        tile_cnt[t] = live ? n : 0;
    }
}
