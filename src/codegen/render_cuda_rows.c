/* render_cuda_rows.c - the CUDA renderer's row kernels (reductions): the
 * row plan (a group of G threads per row, the row held in registers where
 * its chunks fit), the passes over a row, their group reductions and the
 * one-reduction pairs, and the loop over rows. render_cuda.c holds the rest
 * of the renderer and calls kl__cu_render_rows for a kernel that reduces.
 */
#include <math.h>
#include <string.h>

#include "codegen/render_cuda_walk.h"

/* G threads per row of vp->nch chunks: each thread's nj chunks within cap
 * values, its chunks and row-local values within max_bytes, the unrolled
 * element loops within the budget; sets vp->G and vp->nj when they are */
static bool row_fits(const cctx *c, vplan *vp, int G, int cap, int64_t max_bytes)
{
	const kir_kernel *k = c->k;
	int V = vp->V;
	int64_t nj = (vp->nch + G - 1) / G;
	if (nj * V > cap || kl__cu_body_cost(c) * nj * V > UNROLL_BUDGET)
		return false;
	int64_t bytes = 0;
	for (int a = 0; a < vp->nacc; a++)
		bytes += nj * V * msize(vp->acc[a].dt);
	for (int i = 0; i < k->nlocal; i++)
		bytes += nj * V * msize((kl_dtype)k->local_dt[i]);
	if (bytes > max_bytes)
		return false;
	vp->G = G;
	vp->nj = (int)nj;
	return true;
}

/* The group of a dot row (vp->dot): the smallest of 32 ... 256 threads at
 * which a thread holds at most kl_cuda_dot.chunks chunks and the rows keep
 * kl_cuda_dot.threads threads busy (fewer rows: a larger group each; one
 * row: the block), within the limits. Several loads in flight a thread,
 * several rows a block where rows are short; a long row (a down
 * projection's 8192) takes the block. The block when nothing smaller fits
 * the knobs. */
static bool dot_group(const cctx *c, vplan *vp, int cap, int64_t nrows)
{
	kl_cuda_dot kn = kl__cuda_dot_knobs();
	for (int g = 32; g < BLOCK; g *= 2) {
		if ((vp->nch + g - 1) / g > kn.chunks || nrows < ((int64_t)kn.threads + g - 1) / g)
			continue;
		if (row_fits(c, vp, g, cap, ROW_BYTES))
			return true;
	}
	return row_fits(c, vp, BLOCK, cap, ROW_BYTES);
}


/* A wide row: a block's row (not a dot row), whose row-dependent loads
 * take at most 32 bytes a thread (a 4096-wide bf16 softmax, layer or RMS
 * norm row: two 16-byte chunks). Such a kernel streams: the more blocks an
 * SM, the more bytes in flight. So by default it gets __launch_bounds__
 * for ROW_WIDE_MINB blocks and leaves its row-invariant chunks to L1
 * rather than registers (KILN_CUDA_ROW_HOLD=0). On an H200 (run 23,
 * 16384 x 4096 bf16, eight waves) that took softmax from 71.0 to 70.5 us,
 * layer norm from 73.8 (72 registers: three blocks an SM) to 71.9, RMS
 * norm 70.0 either way, RMS norm from primitives 74.6 to 72.2; the same
 * knobs on every row kernel slowed the one-token layer's dot rows from
 * 47.8 to 60.1 us, so dot rows and longer rows keep none.
 * Grids: a wide row's holds at most ROW_WIDE_WAVES waves of resident
 * blocks, every other row kernel's ROW_WAVES (kl_row_grid.waves; the
 * launcher's cap unless KILN_CUDA_WAVES is set). Run 25 (H200,
 * reduce-overhead): 12 waves against 8 on the 16384 x 4096 bf16 rows,
 * softmax 69.7 against 70.0-71.3 us, layer norm 70.1 against 71.3, RMS
 * 69.3 against 70.5-70.6 (16 waves slower again, run 24); one wave against
 * eight on the one-token layer's dot rows, 45.9 against 49.3-49.9 us
 * (a block takes several rows, the next one's weights in flight), mlp24
 * 37.0-37.1 against 37.4-37.7. */
#define ROW_WIDE_MINB 5
#define ROW_WIDE_WAVES 12
#define ROW_WAVES 1
static bool wide_row(const cctx *c, const vplan *vp)
{
	if (vp->dot || vp->G != BLOCK)
		return false;
	int64_t bytes = 0;
	for (int a = 0; a < vp->nacc; a++)
		if (!vp->acc[a].store && row_dependent(c, vp, &vp->acc[a]))
			bytes += (int64_t)vp->nj * vp->V * msize(vp->acc[a].dt);
	return bytes > 0 && bytes <= 32;
}

/* nrows: the rows when static, else INT64_MAX */
static bool plan_rows(cctx *c, vplan *vp, int64_t nrows)
{
	const kir_kernel *k = c->k;
	memset(vp, 0, sizeof *vp);
	vp->d = -1;
	for (int d = 0; d < k->ndim; d++) {
		if (!(k->rmask & (1u << d)) || unit(k, d))
			continue;
		if (vp->d >= 0 || k->dims[d].sym > 0)
			return false; /* one static reduced dim only */
		vp->d = d;
	}
	if (vp->d < 0 || k->dims[vp->d].v <= 0 || !kl__cu_plan_collect(c, vp))
		return false;
	int V = vp->V;
	int64_t rn = k->dims[vp->d].v;
	if (rn % V)
		return false;
	vp->nch = rn / V;
	int wide = 0;
	for (int a = 0; a < vp->nacc; a++)
		wide |= msize(vp->acc[a].dt) == 8;
	for (int i = 0; i < k->nlocal; i++)
		wide |= msize((kl_dtype)k->local_dt[i]) == 8;
	int cap = wide ? ROW_REGS / 2 : ROW_REGS;
	vp->dot = k->npass == 1;
	for (int a = 0; a < vp->nacc; a++)
		vp->dot &= !vp->acc[a].store;
	/* float partials only where every chunked operand is 16-bit: they lose
	 * nothing such inputs had, while f32 inputs keep a double per element
	 * (an 8192-long f32 dot drifted 2.3e-4 relative with partials on an
	 * H200) */
	bool half = vp->nacc > 0;
	for (int a = 0; a < vp->nacc; a++)
		half &= msize(vp->acc[a].dt) == 2;
	/* every row kernel's sums, not only dot rows': a layer norm's two sums
	 * converted each bf16 element to double, 2 x 67 M F2F.F64 at 16 a clock
	 * an SM, about 36 us of its 88 on an H200 (run of 2026-12-03) */
	vp->part = half && kl__cuda_dot_knobs().f32;
	/* A dot row takes dot_group's choice. Otherwise the group: a warp when a lane's share fits (up to cap values and half
	 * the bytes: no barrier at all), else the block. Groups of 64 or 128
	 * threads (several rows a block, fewer chunks a thread) measured slower
	 * on an H200 for 4096-wide bf16 rows (softmax 88.2 vs 82.7 us, layer
	 * norm 96.9 vs 87.1, rms norm from primitives 104.3 vs 92.4 at 128
	 * against the block; 2026-12-03), so they are only taken when forced:
	 * KILN_CUDA_ROW_GROUP forces a group that fits the limits. */
	int force = kl__cuda_row_group();
	bool fits = force && row_fits(c, vp, force, cap, ROW_BYTES);
	if (!fits && vp->dot)
		fits = dot_group(c, vp, cap, nrows);
	if (!fits)
		fits = row_fits(c, vp, 32, cap, ROW_BYTES / 2);
	if (!fits && !row_fits(c, vp, BLOCK, cap, ROW_BYTES))
		return false;
	/* every chunk of the row is loaded at the start of the first pass, all
	 * in flight at once (not a wait for the weights of a layer norm in the
	 * last pass); KILN_CUDA_ROW_HOLD=0 leaves the row-invariant ones in the
	 * block that first uses them, loaded there by every row */
	for (int d = 0; d < k->ndim; d++)
		if (!(k->rmask & (1u << d)))
			vp->outer |= 1u << d;
	kl_cuda_dot kn = kl__cuda_dot_knobs();
	bool wrow = wide_row(c, vp);
	bool hold = kn.hold >= 0 ? kn.hold != 0 : !wrow;
	if (wrow)
		c->waves = ROW_WIDE_WAVES;
	if (wrow && !kn.minb)
		c->minb = ROW_WIDE_MINB;
	for (int a = 0; a < vp->nacc; a++) {
		if (vp->acc[a].store)
			continue;
		if (!hold && !row_dependent(c, vp, &vp->acc[a]))
			vp->acc[a].each = true;
		else
			vp->acc[a].blk = 1;
	}
	return kl__cu_plan_aligned(c, vp);
}

static void open_slots(cctx *c, const vplan *vp);

/* is instruction i the first live float partial's sum of its accumulator
 * in block blk? (one partial per accumulator) */
static bool first_part(const cctx *c, int blk, int32_t i)
{
	const kir_ins *in = &c->k->ins[i];
	if (!c->live[i] || in->blk != blk || !part_acc(in))
		return false;
	for (int32_t j = 0; j < i; j++)
		if (c->live[j] && c->k->ins[j].blk == blk && part_acc(&c->k->ins[j]) &&
		    c->k->ins[j].acc == in->acc)
			return false;
	return true;
}

/* A row's float partials of pass block blk: declared (open) or added to
 * their double accumulators (!open). A thread's share is at most 64
 * products; the F2F.F64 conversion per element, at 16 a clock an SM on
 * sm_90, would otherwise bound the product below the memory's rate (16-bit
 * operands only, vp->part; each partial sums at most 64 of them, far inside
 * a 16-bit result's rounding). A float partial must not overflow where the
 * double sum does not (bf16 has f32's range: a thread's +-3e38 values made
 * a bf16 mean NaN on CUDA where the reference's is finite): a thread whose
 * partial is not finite sums its share again in double from the values it
 * holds (rare: huge, infinite or NaN values), and the group reduces in
 * double (combine), never in float. */
static void dot_partial(cctx *c, const vplan *vp, int blk, bool open)
{
	const kir_kernel *k = c->k;
	if (!vp->part)
		return;
	kl_sb cond = {0};
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (!first_part(c, blk, i))
			continue;
		int a = (int)in->acc;
		if (open)
			line(c, "float kp%d = 0.0f;", a);
		else
			kl__sb_printf(&cond, "%s!(fabsf(kp%d) <= 3.40282347e+38f)", cond.n ? " || " : "",
			              a);
	}
	if (!open && cond.n) {
		line(c, "if (%s)", kl__sb_str(&cond));
		open_brace(c);
		line(c, "/* a partial overflowed (or met inf or NaN): this thread's share in double */");
		for (int32_t i = 0; i < k->nins; i++)
			if (first_part(c, blk, i))
				line(c, "kp%d = 0.0f;", (int)k->ins[i].acc);
		bool each = false;
		for (int a = 0; a < vp->nacc; a++)
			each |= vp->acc[a].each && vp->acc[a].blk == blk;
		open_slots(c, vp);
		if (each)
			kl__cu_chunk_io_to(c, vp, blk, false, "[j]", false, 3);
		line(c, "#pragma unroll");
		line(c, "for (int e = 0; e < %d; e++)", vp->V);
		open_brace(c);
		line(c, "i%d = ch * %d + e;", vp->d, vp->V);
		char lc[32];
		snprintf(lc, sizeof lc, "j * %d + e", vp->V);
		c->redo = true;
		kl__cu_emit_block(c, blk, vp, "[j]", lc);
		c->redo = false;
		close_brace(c);
		close_brace(c);
		close_brace(c);
		close_brace(c);
	}
	if (cond.oom)
		c->sb->oom = true;
	kl__sb_free(&cond);
	for (int32_t i = 0; !open && i < k->nins; i++)
		if (first_part(c, blk, i))
			line(c, "acc%d += (double)kp%d;", (int)k->ins[i].acc, (int)k->ins[i].acc);
}

/* ---- row kernels -------------------------------------------------------------------------- */

/* the group reduction of every accumulator pass p updates (none for a
 * column kernel's one thread a row: its accumulators hold the row's) */
static void combine(cctx *c, int p)
{
	const kir_kernel *k = c->k;
	if (c->G == 1)
		return;
	uint8_t *done = calloc((size_t)k->nacc + 1, 1);
	if (!done) {
		c->sb->oom = true;
		return;
	}
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->opc != KIR_ACC || in->blk != 2 * p - 1 || !c->live[i] || done[in->acc])
			continue;
		done[in->acc] = 1;
		kl_op op = (kl_op)in->op;
		int a = (int)in->acc;
		if (op == KL_OP_ARGMAX) {
			line(c,
			     "{ long long ai_ = acc%di; kl_gargmax<%d>(acc%d, ai_, kl_sh, kl_shi, kl_ph); "
			     "acc%di = ai_; }",
			     a, c->G, a, a);
			continue;
		}
		/* one variable each: float max/min fold NaN in (cu_acc_vars) */
		const char *f = op == KL_OP_SUM   ? "kl_add_op"
		                : op == KL_OP_MAX ? "kl_max_op"
		                : op == KL_OP_MIN ? "kl_min_op"
		                                  : "kl_no_group_reduction_for_this_op";
		line(c, "acc%d = kl_gred<%d>(acc%d, %s(), kl_sh, kl_ph);", a, c->G, a, f);
	}
	free(done);
}

/* pass p over the row, the scalar way: position r = lane + G * j */
static void pass_scalar(cctx *c, int p, uint32_t inner)
{
	const kir_kernel *k = c->k;
	if (c->nj) {
		line(c, "#pragma unroll");
		line(c, "for (int j = 0; j < %d; j++)", c->nj);
		open_brace(c);
		line(c, "const int64_t r = lane + (int64_t)j * %d;", c->G);
		line(c, "if (r >= rn)");
		line(c, "\tbreak;");
	} else {
		/* NVRTC 13.0 crashes (SIGSEGV) unrolling this loop when it divides
		 * the position by a dim's extent, for some extents and G (e.g.
		 * 6 x 50 by 64, 6 x 100 by 256): such loops stay rolled */
		int nd = 0;
		for (int d = 0; d < k->ndim; d++)
			nd += (inner & (1u << d)) && !unit(k, d);
		if (nd > 1)
			line(c, "#pragma unroll 1");
		line(c, "for (int64_t r = lane; r < rn; r += %d)", c->G);
		open_brace(c);
	}
	/* the reduced dims from the flat position in the row */
	kl__cu_decompose_to(c, inner, "r", false);
	kl__cu_emit_block(c, 2 * p - 1, NULL, "", "j");
	close_brace(c);
}

/* the chunk slots of one thread: j, the chunk ch = lane + G * j of the row,
 * i_d at the chunk's start; closed by close_brace twice */
static void open_slots(cctx *c, const vplan *vp)
{
	line(c, "#pragma unroll");
	line(c, "for (int j = 0; j < %d; j++)", vp->nj);
	open_brace(c);
	line(c, "const int64_t ch = lane + (int64_t)j * %d;", vp->G);
	if (vp->nch % vp->G)
		line(c, "if (ch < %lld)", (long long)vp->nch);
	open_brace(c);
	line(c, "i%d = ch * %d;", vp->d, vp->V);
}

/* pass p over a row held in registers: thread lane has the chunks
 * lane + G * j, all loaded (in flight together) before the first pass
 * reads them */
static void pass_chunks(cctx *c, int p, const vplan *vp)
{
	int V = vp->V, d = vp->d, blk = 2 * p - 1;
	bool loads = false, each = false, stores = false;
	for (int a = 0; a < vp->nacc; a++) {
		loads |= !vp->acc[a].store && vp->acc[a].blk == blk && !vp->acc[a].each;
		each |= vp->acc[a].each && vp->acc[a].blk == blk;
		stores |= vp->acc[a].store && vp->acc[a].blk == blk;
	}
	if (loads) {
		/* a later row's chunks came ahead (and row-invariant ones, such
		 * as a norm's weight, are still held, unless KILN_CUDA_ROW_HOLD=0
		 * has every row load them below): loaded on the first only */
		line(c, "if (!kl_ahead)");
		open_brace(c);
		open_slots(c, vp);
		kl__cu_chunk_io_to(c, vp, blk, false, "[j]", false, c->early ? 2 : 0);
		close_brace(c);
		close_brace(c);
		close_brace(c);
		/* the next row's chunks, in flight while this one is reduced */
		bool any = false;
		for (int a = 0; a < vp->nacc; a++)
			any |= !vp->acc[a].store && vp->acc[a].blk == blk &&
			       row_dependent(c, vp, &vp->acc[a]);
		if (any) {
			open_brace(c);
			line(c, "const int64_t kl_next = row + (int64_t)gridDim.x * %d;",
			     BLOCK / vp->G);
			line(c, "if (kl_next < nrows)");
			open_brace(c);
			kl__cu_decompose(c, vp->outer, "kl_next");
			open_slots(c, vp);
			kl__cu_chunk_io_to(c, vp, blk, false, "[j]", true, 0);
			close_brace(c);
			close_brace(c);
			close_brace(c);
			close_brace(c);
		}
	}
	dot_partial(c, vp, blk, true);
	open_slots(c, vp);
	/* KILN_CUDA_ROW_HOLD=0: this row's row-invariant chunks, each right
	 * before the elements that read it */
	if (each)
		kl__cu_chunk_io_to(c, vp, blk, false, "[j]", false, 3);
	line(c, "#pragma unroll");
	line(c, "for (int e = 0; e < %d; e++)", V);
	open_brace(c);
	line(c, "i%d = ch * %d + e;", d, V);
	char lc[32];
	snprintf(lc, sizeof lc, "j * %d + e", V);
	kl__cu_emit_block(c, blk, vp, "[j]", lc);
	close_brace(c);
	if (stores) {
		line(c, "i%d = ch * %d;", d, V);
		kl__cu_chunk_io(c, vp, blk, true, "[j]");
	}
	close_brace(c);
	close_brace(c);
	dot_partial(c, vp, blk, false);
}

static void pass_body(cctx *c, int p, const vplan *vp, uint32_t inner)
{
	if (vp)
		pass_chunks(c, p, vp);
	else
		pass_scalar(c, p, inner);
}

/* block blk with only (or without) the instructions of the opcodes in mask */
static void emit_part(cctx *c, int blk, uint32_t mask)
{
	c->mask = mask;
	kl__cu_emit_block(c, blk, NULL, "", "0");
	c->mask = ~0u;
}

/* Passes p and p+1 of a matched pair (row_onepass.h) with one group
 * reduction: each thread reduces its own values in both passes, pass p+1
 * seeing block 2p computed from its own partial result (a thread of -inf
 * values subtracts 0; VAR: the sum scaled so that M is the thread's mean);
 * the partials merge; block 2p then runs on the row's result, and pass
 * p+1's sum is moved to the row's M. */
static void onepass_pair(cctx *c, const kl_onepass *op, const vplan *vp, uint32_t inner)
{
	const kir_kernel *k = c->k;
	int p = op->p, a = (int)op->acc_a, b = (int)op->acc_b, m = (int)op->m, G = c->G;
	const uint32_t init = 1u << KIR_ACC_INIT, store = 1u << KIR_STORE;
	const char *mt = c->r->ctype[k->ins[op->m].dt];
	bool lse = op->kind == KL_ONEPASS_LSE;
	line(c, "/* passes %d and %d, one reduction: %s */", p, p + 1,
	     lse ? "max and sum of exp" : "count, sum and squared deviations");
	c->pair = true;
	pass_body(c, p, vp, inner);
	emit_part(c, 2 * p, init);
	if (lse) {
		kl_dtype adt = KL_F32;
		for (int32_t i = 0; i < k->nins; i++)
			if (k->ins[i].opc == KIR_ACC && k->ins[i].acc == op->acc_a)
				adt = (kl_dtype)k->ins[i].in_dt;
		line(c, "const %s kl_m%d = acc%d;", c->r->ctype[adt], p, a);
	} else {
		if (vp)
			line(c, "double kl_n%d = %d.0 * (%lld > lane ? (%lld - lane + %d) / %d : 0);", p,
			     vp->V, (long long)vp->nch, (long long)vp->nch, G - 1, G);
		else
			line(c, "double kl_n%d = (double)(rn > lane ? (rn - lane + %d) / %d : 0);", p,
			     G - 1, G);
		line(c, "const double kl_s%d = acc%d;", p, a);
	}
	line(c, "%s kl_ml%d;", mt, p);
	open_brace(c);
	if (lse)
		line(c, "acc%d = acc%d == -INFINITY ? 0 : acc%d;", a, a, a);
	else
		line(c, "acc%d = kl_n%d > 0 ? acc%d * (%lld.0 / kl_n%d) : 0;", a, p, a,
		     (long long)op->n, p);
	emit_part(c, 2 * p, ~(init | store));
	line(c, "acc%d = kl_%s%d;", a, lse ? "m" : "s", p);
	line(c, "kl_ml%d = t%d;", p, m);
	pass_body(c, p + 1, vp, inner);
	c->pair = false;
	close_brace(c);
	if (lse) {
		line(c, "acc%d = kl_rebase(acc%d, kl_ml%d, (%s)acc%d);", b, b, p, mt, a);
		line(c, "kl_glse<%d>(acc%d, acc%d, kl_sh, kl_shi, kl_ph);", G, a, b);
		/* a row of -inf: every exp(v - M) is NaN */
		line(c, "if (acc%d == -INFINITY && rn > 0)", a);
		line(c, "\tacc%d = NAN;", b);
	} else {
		line(c, "if (kl_n%d > 0)", p);
		line(c, "\tacc%d -= kl_n%d * (kl_s%d / kl_n%d - (double)kl_ml%d) * "
		        "(kl_s%d / kl_n%d - (double)kl_ml%d);",
		     b, p, p, p, p, p, p, p);
		/* sums of squares about 0 for values of f32 or narrower (held in
		 * double), Chan's merge for f64 */
		bool sq = k->ins[op->m].dt != KL_F64;
		line(c, "kl_gvar<%d, %s>(kl_n%d, acc%d, acc%d, kl_sh, kl_shi, kl_shv, kl_ph);", G,
		     sq ? "true" : "false", p, a, b);
	}
	emit_part(c, 2 * p, ~init);
	if (lse) {
		line(c, "acc%d = kl_rebase(acc%d, (%s)acc%d, t%d);", b, b, mt, a, m);
		bool held = false;
		for (int i = 0; i < KIR_MAX_LOCAL; i++)
			if (op->held[i] >= 0) {
				c->fixp[i] = p;
				held = true;
			}
		if (held)
			line(c, "const %s kl_fx%d = kl_lse_fix((%s)kl_m%d, kl_ml%d, (%s)acc%d, t%d);", mt,
			     p, mt, p, p, mt, a, m);
	} else {
		line(c, "acc%d += %lld.0 * (acc%d / %lld.0 - (double)t%d) * (acc%d / %lld.0 - (double)t%d);",
		     b, (long long)op->n, a, (long long)op->n, m, a, (long long)op->n, m);
	}
}

/* the loop over rows: a group of G threads per row; with vp, the row in
 * registers */
static void row_loop(cctx *c, uint32_t outer, uint32_t inner, int G, const vplan *vp)
{
	const kir_kernel *k = c->k;
	c->G = G;
	int per = BLOCK / G;
	if (!c->per)
		c->per = per;
	open_brace(c);
	if (vp)
		line(c, "/* row group: %d threads, %d rows a block, %d chunks of %d a thread */", G,
		     per, vp->nj, vp->V);
	else
		line(c, "/* row group (scalar): %d threads, %d rows a block */", G, per);
	line(c, "const int lane = threadIdx.x %% %d;", G);
	line(c, "int kl_ph = 0; /* which half of kl_sh the next reduction uses */");
	line(c, "(void)kl_ph;");
	if (vp) {
		/* the row's chunks, kept across rows: kn<a> holds the next row's */
		kl__cu_chunk_decls(c, vp, vp->nj);
		for (int a = 0; a < vp->nacc; a++) {
			if (vp->acc[a].store || !row_dependent(c, vp, &vp->acc[a]))
				continue;
			const char *w;
			int nw;
			kl__cu_chunk_word(vp, &vp->acc[a], &w, &nw);
			line(c, "union { %s u[%d]; %s e[%d]; } kn%d[%d];", w, nw,
			     c->r->mtype[vp->acc[a].dt], vp->V, a, vp->nj);
		}
		line(c, "bool kl_ahead = false;");
	}
	c->early = false;
	if (c->wait) {
		/* the first row's chunks of buffers no step writes (weights) are
		 * in flight while the kernel before this one finishes */
		bool any = false;
		for (int a = 0; vp && !c->one && a < vp->nacc; a++)
			any |= kl__cu_early_acc(c, &vp->acc[a]);
		if (any) {
			open_brace(c);
			line(c, "const int64_t row = (int64_t)blockIdx.x * %d + threadIdx.x / %d;", per,
			     G);
			line(c, "if (row < nrows)");
			open_brace(c);
			kl__cu_decompose(c, outer, "row");
			for (int d = 0; d < k->ndim; d++)
				if (inner & (1u << d))
					line(c, "int64_t i%d = 0;", d);
			open_slots(c, vp);
			kl__cu_chunk_io_to(c, vp, 1, false, "[j]", false, 1);
			close_brace(c);
			close_brace(c);
			close_brace(c);
			close_brace(c);
			c->early = true;
		}
		line(c, "kl_pdl_wait();");
	}
	/* every thread of a group runs the same number of iterations: the
	 * shuffles and barriers inside see full groups */
	line(c,
	     "for (int64_t row = (int64_t)blockIdx.x * %d + threadIdx.x / %d; row < nrows; "
	     "row += (int64_t)gridDim.x * %d)",
	     per, G, per);
	open_brace(c);
	kl__cu_decompose(c, outer, "row");
	for (int d = 0; d < k->ndim; d++)
		if (inner & (1u << d))
			line(c, "int64_t i%d = 0;", d);
	int slots = vp ? vp->nj * vp->V : c->nj;
	for (int i = 0; i < k->nlocal; i++)
		line(c, "%s lc%d[%d];", c->r->ctype[k->local_dt[i]], i, slots);
	kl__cu_emit_block(c, 0, NULL, "", "0");
	memset(c->fixp, 0, sizeof c->fixp);
	for (int p = 1; p <= k->npass; p++) {
		if (c->one && c->one[p].kind != KL_ONEPASS_NONE) {
			onepass_pair(c, &c->one[p], vp, inner);
			p++;
		} else {
			pass_body(c, p, vp, inner);
			combine(c, p);
		}
		kl__cu_emit_block(c, 2 * p, NULL, "", "0");
	}
	if (vp) {
		for (int a = 0; a < vp->nacc; a++) {
			if (vp->acc[a].store || !row_dependent(c, vp, &vp->acc[a]))
				continue;
			const char *w;
			int nw;
			kl__cu_chunk_word(vp, &vp->acc[a], &w, &nw);
			line(c, "#pragma unroll");
			line(c, "for (int j = 0; j < %d; j++)", vp->nj);
			line(c, "\tfor (int u = 0; u < %d; u++)", nw);
			line(c, "\t\tkv%d[j].u[u] = kn%d[j].u[u];", a, a);
		}
		line(c, "kl_ahead = true;");
	}
	close_brace(c);
	close_brace(c);
}

/* A column reduction: the kernel's innermost dim (the contiguous one of a
 * dense operand) is kept and the rows are short, e.g. the first pass of a
 * sum over the rows of [R, C] (a bias gradient: decompose.c makes it
 * partial sums of COL_ROWS rows, [R / COL_ROWS, COL_ROWS, C], then their
 * sum). A group of threads per output reads one column, G lanes G rows
 * apart: every lane of a warp a sector of its own. One thread per output
 * instead, consecutive threads consecutive outputs: a warp reads 32
 * neighbouring elements of one row a step (coalesced), each thread its
 * column's rows in order, no group reduction. Only where there are outputs
 * to fill the device (COL_MIN_OUT threads) and each thread's loop is short
 * (COL_MAX_ROWS); single-pass kernels without row-local arrays. */
#define COL_MIN_OUT 8192
#define COL_MAX_ROWS 64
static bool column_kernel(const cctx *c, bool nstat, double nrows, bool rstat, double vr)
{
	const kir_kernel *k = c->k;
	if (!nstat || !rstat || nrows < COL_MIN_OUT || vr > COL_MAX_ROWS || k->nlocal ||
	    k->npass != 1 || kl__cuda_row_group())
		return false;
	for (int d = k->ndim - 1; d >= 0; d--)
		if (!unit(k, d))
			return !(k->rmask & (1u << d));
	return false;
}

void kl__cu_render_rows(cctx *c)
{
	const kir_kernel *k = c->k;
	c->waves = ROW_WAVES; /* a wide row's plan raises it */
	uint32_t outer = 0, inner = 0;
	for (int d = 0; d < k->ndim; d++) {
		if (k->rmask & (1u << d))
			inner |= 1u << d;
		else
			outer |= 1u << d;
	}
	kl_sb rows = {0}, rn = {0};
	double nrows, vr;
	bool nstat = kl__render_extent(c->r, k, outer, &rows, &nrows);
	bool rstat = kl__render_extent(c->r, k, inner, &rn, &vr);
	/* the scalar path: the smallest group at which a thread takes at most
	 * 8 positions of a static row, else the block */
	bool col = column_kernel(c, nstat, nrows, rstat, vr);
	int G = col ? 1 : kl__cuda_row_group();
	for (int g = 32; !G && rstat && g < BLOCK; g *= 2)
		if (vr <= 8.0 * g)
			G = g;
	if (!G)
		G = BLOCK;
	c->nj = k->nlocal ? (int)((k->row_n + G - 1) / G) : 0;
	line(c, "__shared__ unsigned long long kl_sh[%d];", 2 * BLOCK / 32);
	line(c, "__shared__ long long kl_shi[%d];", 2 * BLOCK / 32);
	line(c, "(void)kl_sh;");
	line(c, "(void)kl_shi;");
	/* pairs of passes that one reduction serves */
	kl_onepass *one = NULL;
	bool var = false;
	if (!col && kl__cuda_row_onepass() && k->npass >= 2 &&
	    !(one = calloc((size_t)k->npass + 2, sizeof *one)))
		c->sb->oom = true;
	for (int p = 1; one && p < k->npass; p++) {
		/* a pass that ends a pair starts none */
		if (one[p - 1].kind == KL_ONEPASS_NONE)
			kl__onepass_match(k, c->live, p, rstat ? (int64_t)vr : 0, &one[p]);
		var |= one[p].kind == KL_ONEPASS_VAR;
	}
	c->one = one;
	if (var)
		line(c, "__shared__ unsigned long long kl_shv[%d];", 2 * BLOCK / 32);
	line(c, "const int64_t nrows = %s, rn = %s;", kl__sb_str(&rows), kl__sb_str(&rn));
	line(c, "(void)rn;");
	vplan vp;
	memset(&vp, 0, sizeof vp);
	if (!col && plan_rows(c, &vp, nstat && nrows < 9.0e18 ? (int64_t)nrows : INT64_MAX)) {
		kl__cu_plan_cond(c, &vp);
		line(c, "if (kl_vok)");
		row_loop(c, outer, inner, vp.G, &vp);
		line(c, "else");
	}
	row_loop(c, outer, inner, G, NULL);
	kl__cu_plan_free(&vp);
	c->one = NULL;
	free(one);
	kl__sb_free(&rows);
	kl__sb_free(&rn);
}

