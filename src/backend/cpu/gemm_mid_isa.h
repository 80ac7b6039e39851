/* gemm_mid_isa.h - the half of gemm_mid.c that depends on the vector
 * width: B's packing, the register tiles and the loop over one block of C.
 * gemm_mid.c includes it once for each instruction set, with
 *   GMI(x)      the names' suffix (x ## _v4, x ## _v3)
 *   GMI_VW      floats a vector (16: zmm, 8: ymm)
 *   GMI_MR      rows of the big tile (its accumulators, MR x 2 vectors, and
 *               the panel's two vectors and one broadcast fit the register file)
 *   GMI_TARGET  the function attribute that compiles for that set
 * and gets GMI(isa), the gm_isa the driver calls through. A panel is two
 * vectors wide (GMI_NR columns), k-major. Not a header of its own: it
 * reads gemm_mid.c's gm_job, gm_isa and GM_* names.
 */
#define GMI_NR (2 * GMI_VW)

typedef float GMI(gm_v) __attribute__((vector_size(GMI_VW * 4)));
typedef int GMI(gm_vi) __attribute__((vector_size(GMI_VW * 4)));

/* GMI_VW rows of GMI_VW floats (row stride ld) into GMI_VW rows (row
 * stride GMI_NR), transposed: round s swaps the off-diagonal s x s blocks
 * of each 2s x 2s block (rows i and i + s trade their lanes with bit s set
 * in i's for those with it clear in i + s's). MASK(S) is the shuffle that
 * keeps row i's lanes with bit S clear and takes row i + S's in between. */
#define GMI_SWAP(S, ...)                                                                    \
	for (int i = 0; i < GMI_VW; i++)                                                    \
		if (!(i & (S))) {                                                           \
			GMI(gm_v) x = v[i], y = v[i + (S)];                                 \
			const GMI(gm_vi) lo = {__VA_ARGS__};                                \
			v[i] = __builtin_shuffle(x, y, lo);                                 \
			v[i + (S)] = __builtin_shuffle(x, y, lo + (S));                     \
		}

GMI_TARGET static inline void GMI(gm_transpose)(const float *s, size_t ld, float *d, bool pf)
{
	GMI(gm_v) v[GMI_VW];
	for (int i = 0; i < GMI_VW; i++) {
		memcpy(&v[i], s + (size_t)i * ld, sizeof v[i]);
		/* the row's line 64 floats on, where the row has one (the
		 * rows of a panel are more streams than the hardware follows:
		 * 1-4% of the FFN's products on the Zen 4) */
		if (pf)
			__builtin_prefetch(s + (size_t)i * ld + 64);
	}
#if GMI_VW == 16
	GMI_SWAP(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
	GMI_SWAP(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
	GMI_SWAP(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
	GMI_SWAP(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#elif GMI_VW == 8
	GMI_SWAP(1, 0, 8, 2, 10, 4, 12, 6, 14)
	GMI_SWAP(2, 0, 1, 8, 9, 4, 5, 12, 13)
	GMI_SWAP(4, 0, 1, 2, 3, 8, 9, 10, 11)
#else
#error "gemm_mid_isa.h: GMI_VW is 8 or 16"
#endif
	for (int i = 0; i < GMI_VW; i++)
		memcpy(d + (size_t)i * GMI_NR, &v[i], sizeof v[i]);
}
#undef GMI_SWAP

/* B's depth [p0, p0 + kc) by columns [j0, j0 + nc) into panels of GMI_NR
 * columns, k-major, zero past nc */
GMI_TARGET static void GMI(gm_pack)(const gm_job *jb, float *dst, int p0, int kc, int j0, int nc)
{
	const kl_gemm_small *g = &jb->g;
	size_t ld = (size_t)g->ldw;
	for (int jp = 0; jp < nc; jp += GMI_NR) {
		int w = nc - jp < GMI_NR ? nc - jp : GMI_NR;
		float *d = dst + (size_t)jp * (size_t)kc;
		if (jb->w_kn) {
			const float *s = g->W + (size_t)p0 * ld + (size_t)(j0 + jp);
			for (int p = 0; p < kc; p++) {
				const float *sp = s + (size_t)p * ld;
				float *dp = d + (size_t)p * GMI_NR;
				for (int c = 0; c < w; c++)
					dp[c] = sp[c];
				for (int c = w; c < GMI_NR; c++)
					dp[c] = 0;
			}
			continue;
		}
		const float *s = g->W + (size_t)(j0 + jp) * ld + (size_t)p0;
		int p = 0;
		if (w == GMI_NR)
			for (; p + GMI_VW <= kc; p += GMI_VW)
				for (int h = 0; h < GMI_NR; h += GMI_VW)
					GMI(gm_transpose)(s + (size_t)h * ld + (size_t)p, ld,
					                  d + (size_t)p * GMI_NR + (size_t)h,
					                  p + 64 + GMI_VW <= kc);
		for (int c = 0; c < w; c++)
			for (int q = p; q < kc; q++)
				d[(size_t)q * GMI_NR + (size_t)c] = s[(size_t)c * ld + (size_t)q];
		for (int c = w; c < GMI_NR; c++)
			for (int q = 0; q < kc; q++)
				d[(size_t)q * GMI_NR + (size_t)c] = 0;
	}
}

/* rows [0, MR) of C (row stride ldc) by columns [0, nr) of one panel b:
 * the sums over kc of a[r][p] * b[p][c]; C's tile fetched for writing
 * while the sums run */
#define GMI_TILE(NAME, MR)                                                                  \
	GMI_TARGET static void NAME(int kc, const float *a, size_t lda, const float *b,     \
	                            float *c, size_t ldc, int nr, float alpha, float beta,  \
	                            int mode)                                               \
	{                                                                                   \
		GMI(gm_v) s[MR][2];                                                         \
		_Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) s[r][0] = s[r][1] =   \
		        (GMI(gm_v)){0};                                                     \
		for (int r = 0; r < MR; r++) {                                              \
			__builtin_prefetch(c + (size_t)r * ldc, 1);                         \
			__builtin_prefetch(c + (size_t)r * ldc + GMI_VW, 1);                \
		}                                                                           \
		for (int p = 0; p < kc; p++) {                                              \
			GMI(gm_v) b0, b1;                                                   \
			memcpy(&b0, b + (size_t)p * GMI_NR, sizeof b0);                     \
			memcpy(&b1, b + (size_t)p * GMI_NR + GMI_VW, sizeof b1);            \
			_Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)               \
			{                                                                   \
				float x = a[(size_t)r * lda + (size_t)p];                   \
				s[r][0] += x * b0;                                          \
				s[r][1] += x * b1;                                          \
			}                                                                   \
		}                                                                           \
		if (nr == GMI_NR) {                                                         \
			_Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)               \
			        _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++)         \
			{                                                                   \
				float *cp = c + (size_t)r * ldc + GMI_VW * v;               \
				GMI(gm_v) o, y = alpha * s[r][v];                           \
				if (mode != GM_SET) {                                       \
					memcpy(&o, cp, sizeof o);                           \
					y += (mode == GM_ADD ? 1.0f : beta) * o;            \
				}                                                           \
				memcpy(cp, &y, sizeof y);                                   \
			}                                                                   \
			return;                                                             \
		}                                                                           \
		for (int r = 0; r < MR; r++) {                                              \
			float t[GMI_NR], *cp = c + (size_t)r * ldc;                         \
			memcpy(t, s[r], sizeof t);                                          \
			for (int q = 0; q < nr; q++) {                                      \
				float v = alpha * t[q];                                     \
				cp[q] = mode == GM_SET    ? v                               \
				        : mode == GM_ADD ? cp[q] + v                        \
				                          : v + beta * cp[q];               \
			}                                                                   \
		}                                                                           \
	}

GMI_TILE(GMI(gm_tile_big), GMI_MR)
#if GMI_MR > 8
GMI_TILE(GMI(gm_tile8), 8)
#endif
GMI_TILE(GMI(gm_tile4), 4)
GMI_TILE(GMI(gm_tile2), 2)
GMI_TILE(GMI(gm_tile1), 1)
#undef GMI_TILE

/* rows [0, mr) (mr <= GMI_MR) by one panel: the big tile, the last rows
 * in tiles of 8, 4, 2 and 1 */
GMI_TARGET static void GMI(gm_rows)(int mr, int kc, const float *a, size_t lda, const float *b,
                                    float *c, size_t ldc, int nr, float alpha, float beta,
                                    int mode)
{
	if (mr == GMI_MR) {
		GMI(gm_tile_big)(kc, a, lda, b, c, ldc, nr, alpha, beta, mode);
		return;
	}
	int i = 0;
#define GMI_PART(T, R)                                                                       \
	if (mr - i >= (R)) {                                                                 \
		T(kc, a + (size_t)i * lda, lda, b, c + (size_t)i * ldc, ldc, nr, alpha, beta, mode); \
		i += (R);                                                                    \
	}
#if GMI_MR > 8
	GMI_PART(GMI(gm_tile8), 8)
#endif
	GMI_PART(GMI(gm_tile4), 4)
	GMI_PART(GMI(gm_tile2), 2)
	GMI_PART(GMI(gm_tile1), 1)
#undef GMI_PART
}

/* C's rows [i0, i1) by columns [j0, j1): B packed here a block at a time
 * into pack (or read from jb->pre), the epilogue on each row block's
 * columns after the block's last k */
GMI_TARGET static void GMI(gm_block)(const gm_job *jb, int i0, int i1, int j0, int j1, float *pack)
{
	float *abuf = jb->pre ? pack : pack + (size_t)jb->kb * (size_t)jb->nc;
	const kl_gemm_small *g = &jb->g;
	int k = g->k;
	bool epi = g->R || g->bias || g->act != KL_OP_INPUT;
	size_t lda = (size_t)g->lda, ldc = (size_t)g->ldc;
	int kb = jb->kb;
	for (int jc = j0; jc < j1; jc += jb->nc) {
		int nc = j1 - jc < jb->nc ? j1 - jc : jb->nc;
		for (int pc = 0; pc < k; pc += kb) {
			int kc = k - pc < kb ? k - pc : kb;
			int mode = pc > 0 ? GM_ADD : g->beta == 0 ? GM_SET : GM_SET_BETA;
			bool last = pc + kc >= k;
			if (!jb->pre)
				GMI(gm_pack)(jb, pack, pc, kc, jc, nc);
			for (int i = i0; i < i1; i += GMI_MR) {
				int mr = i1 - i < GMI_MR ? i1 - i : GMI_MR;
				const float *a = g->A + (size_t)i * lda + (size_t)pc;
				size_t la = lda;
				if (jb->acopy) {
					la = (size_t)kb + 16;
					for (int r = 0; r < mr; r++)
						memcpy(abuf + (size_t)r * la, a + (size_t)r * lda,
						       (size_t)kc * sizeof(float));
					a = abuf;
				}
				float *c = g->C + (size_t)i * ldc + (size_t)jc;
				for (int jr = 0; jr < nc; jr += GMI_NR) {
					int nr = nc - jr < GMI_NR ? nc - jr : GMI_NR;
					const float *b =
					        jb->pre ? jb->pre + (size_t)(jc + jr) * (size_t)k +
					                          (size_t)pc * GMI_NR
					                : pack + (size_t)jr * (size_t)kc;
					GMI(gm_rows)(mr, kc, a, la, b, c + jr, ldc, nr, g->alpha,
					             g->beta, mode);
				}
				if (last && epi)
					gm_epilogue(g, i, i + mr, jc, jc + nc);
			}
		}
	}
}

static const gm_isa GMI(gm_isa) = {
        .nr = GMI_NR, .mr = GMI_MR, .pack = GMI(gm_pack), .block = GMI(gm_block)};

#undef GMI_NR
