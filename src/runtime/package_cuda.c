/* package_cuda.c - the kernels section of a CUDA package as bytes: parse
 * and check it before anything reaches the driver, write it, and choose the
 * image a GPU runs. No CUDA here: a CPU-only process inspects and fuzzes it.
 *
 * Layout (little-endian):
 *   0   "KLCUDA1\0"
 *   8   u32 architecture of the cubins (90), u32 modules (<= 64)
 *   16  u64 bytes of launch choices (0: none)
 *   24  per module 32 bytes: u32 role (0 plan, 1 fixed), u32 flags (1:
 *       arch-specific cubin), u64 source key (fixed modules), u64 cubin
 *       bytes, u64 PTX bytes
 *   then per module its cubin, then its PTX; then the choices. Nothing else.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/le.h"
#include "runtime/package_cuda.h"

#define MAGIC "KLCUDA1"
#define FIXED 24u
#define ENTRY 32u

int kl__pkg_cuda_target_arch(const char *t)
{
	if (strncmp(t, "cuda-sm_", 8) != 0)
		return 0;
	int v = 0, k = 0;
	for (const char *s = t + 8; *s; s++, k++) {
		if (*s < '0' || *s > '9' || k >= 3)
			return 0;
		v = v * 10 + (*s - '0');
	}
	return k >= 2 && t[8] != '0' && v >= 30 ? v : 0;
}

/* a 64-bit little-endian ELF file for the CUDA machine (EM_CUDA, 190)
 * whose header, program headers and section headers all lie inside it,
 * as does every section with contents: the driver follows those offsets
 * without checking them, so a damaged table must stop here */
static bool cubin_ok(const uint8_t *b, size_t n)
{
	if (n < 64 || memcmp(b, "\x7f" "ELF", 4) != 0 || b[4] != 2 || b[5] != 1 ||
	    kl__le_get16(b + 18) != 190 || kl__le_get16(b + 52) != 64)
		return false;
	uint64_t phoff = kl__le_get64(b + 32), shoff = kl__le_get64(b + 40);
	unsigned phent = kl__le_get16(b + 54), phnum = kl__le_get16(b + 56);
	unsigned shent = kl__le_get16(b + 58), shnum = kl__le_get16(b + 60);
	unsigned shstr = kl__le_get16(b + 62);
	if ((phnum && (phent != 56 || phoff > n || (uint64_t)phnum * 56 > n - phoff)) ||
	    shent != 64 || shnum == 0 || shoff > n || (uint64_t)shnum * 64 > n - shoff ||
	    shstr >= shnum)
		return false;
	for (unsigned i = 0; i < phnum; i++) {
		const uint8_t *ph = b + phoff + (size_t)i * 56;
		uint64_t off = kl__le_get64(ph + 8), sz = kl__le_get64(ph + 32);
		if (off > n || sz > n - off)
			return false;
	}
	for (unsigned i = 0; i < shnum; i++) {
		const uint8_t *sh = b + shoff + (size_t)i * 64;
		uint64_t off = kl__le_get64(sh + 24), sz = kl__le_get64(sh + 32);
		if (kl__le_get32(sh + 4) != 8 /* SHT_NOBITS */ && (off > n || sz > n - off))
			return false;
	}
	return true;
}

/* printable text (tabs and newlines too) naming its target */
static bool ptx_ok(const char *p, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		unsigned char ch = (unsigned char)p[i];
		if (!(ch == '\n' || ch == '\t' || ch == '\r' || (ch >= 32 && ch < 127)))
			return false;
	}
	static const char tgt[] = ".target sm_";
	for (size_t i = 0; i + sizeof tgt - 1 <= n; i++)
		if (memcmp(p + i, tgt, sizeof tgt - 1) == 0)
			return true;
	return false;
}

kl_status kl__pkg_cuda_parse(const uint8_t *p, size_t n, int arch, int32_t nkernels,
                             kl_pkg_cuda *out, char *why, size_t cap)
{
	memset(out, 0, sizeof *out);
	if (n < FIXED || memcmp(p, MAGIC, 8) != 0)
		return kl__plan_fail(why, cap, "the CUDA kernels section is not one (bad magic or %zu bytes)",
		                     n);
	uint32_t a = kl__le_get32(p + 8), nm = kl__le_get32(p + 12);
	uint64_t nch = kl__le_get64(p + 16);
	if ((int)a != arch)
		return kl__plan_fail(why, cap, "the CUDA kernels are for sm_%u, the header says sm_%d", a,
		                     arch);
	if (nm > KL_PKG_CUDA_MODS || n - FIXED < (uint64_t)nm * ENTRY)
		return kl__plan_fail(why, cap, "the CUDA kernels section lists %u modules (at most %d)",
		                     nm, KL_PKG_CUDA_MODS);
	uint64_t at = FIXED + (uint64_t)nm * ENTRY;
	int nplan = 0;
	out->arch = arch;
	out->nmods = (int)nm;
	for (uint32_t i = 0; i < nm; i++) {
		const uint8_t *e = p + FIXED + (size_t)i * ENTRY;
		kl_pkg_cumod *m = &out->mods[i];
		uint32_t role = kl__le_get32(e), flags = kl__le_get32(e + 4);
		uint64_t cn = kl__le_get64(e + 16), pn = kl__le_get64(e + 24);
		if (role > KL_PKG_MOD_FIXED || flags > 1 || (role == KL_PKG_MOD_PLAN && flags))
			return kl__plan_fail(why, cap, "CUDA module %u has role %u, flags %u", i, role,
			                     flags);
		if (cn > n - at || pn > n - at - cn)
			return kl__plan_fail(why, cap, "CUDA module %u lies outside its section", i);
		m->role = (int)role;
		m->arch_specific = flags & 1;
		m->src_key = kl__le_get64(e + 8);
		m->cubin = p + at;
		m->cubin_len = (size_t)cn;
		m->ptx = (const char *)p + at + cn;
		m->ptx_len = (size_t)pn;
		at += cn + pn;
		if (!cubin_ok(m->cubin, m->cubin_len))
			return kl__plan_fail(why, cap, "CUDA module %u's cubin is not a CUDA ELF file", i);
		if (pn && !ptx_ok(m->ptx, m->ptx_len))
			return kl__plan_fail(why, cap, "CUDA module %u's PTX is not PTX text", i);
		nplan += role == KL_PKG_MOD_PLAN;
		for (uint32_t j = 0; j < i; j++)
			if (role == KL_PKG_MOD_FIXED && out->mods[j].role == KL_PKG_MOD_FIXED &&
			    out->mods[j].src_key == m->src_key &&
			    out->mods[j].arch_specific == m->arch_specific)
				return kl__plan_fail(why, cap, "CUDA modules %u and %u are one module", j, i);
	}
	if (nplan != (nkernels > 0 ? 1 : 0))
		return kl__plan_fail(why, cap, "%d CUDA plan modules for a plan of %d kernels", nplan,
		                     (int)nkernels);
	if (nch != n - at)
		return kl__plan_fail(why, cap, "the CUDA kernels section has %" PRIu64
		                     " bytes of choices where %zu are left", nch, (size_t)(n - at));
	out->choices = nch ? p + at : NULL;
	out->choices_len = (size_t)nch;
	return KL_OK;
}

kl_status kl__pkg_cuda_write(const kl_pkg_cuda *c, uint8_t **out, size_t *len)
{
	size_t n = FIXED + (size_t)c->nmods * ENTRY + c->choices_len;
	for (int i = 0; i < c->nmods; i++)
		n += c->mods[i].cubin_len + c->mods[i].ptx_len;
	uint8_t *b = malloc(n);
	if (!b)
		return KL_ENOMEM;
	memcpy(b, MAGIC, 8);
	kl__le_put32(b + 8, (uint32_t)c->arch);
	kl__le_put32(b + 12, (uint32_t)c->nmods);
	kl__le_put64(b + 16, c->choices_len);
	size_t at = FIXED + (size_t)c->nmods * ENTRY;
	for (int i = 0; i < c->nmods; i++) {
		const kl_pkg_cumod *m = &c->mods[i];
		uint8_t *e = b + FIXED + (size_t)i * ENTRY;
		kl__le_put32(e, (uint32_t)m->role);
		kl__le_put32(e + 4, m->arch_specific ? 1u : 0u);
		kl__le_put64(e + 8, m->src_key);
		kl__le_put64(e + 16, m->cubin_len);
		kl__le_put64(e + 24, m->ptx_len);
		memcpy(b + at, m->cubin, m->cubin_len);
		at += m->cubin_len;
		if (m->ptx_len)
			memcpy(b + at, m->ptx, m->ptx_len);
		at += m->ptx_len;
	}
	if (c->choices_len)
		memcpy(b + at, c->choices, c->choices_len);
	*out = b;
	*len = n;
	return KL_OK;
}

kl_status kl__pkg_cuda_pick(const kl_pkg_cuda *c, int dev_arch, bool *use_ptx, char *why,
                            size_t cap)
{
	*use_ptx = false;
	if (dev_arch / 10 == c->arch / 10 && dev_arch >= c->arch)
		return KL_OK;
	bool ptx = true;
	for (int i = 0; i < c->nmods; i++)
		if (c->mods[i].role == KL_PKG_MOD_PLAN && !c->mods[i].ptx_len)
			ptx = false;
	if (dev_arch > c->arch && ptx) {
		*use_ptx = true;
		return KL_OK;
	}
	snprintf(why, cap,
	         "its kernels are built for sm_%d%s; this GPU is sm_%d (a cubin runs on sm_%d.x at "
	         "or above sm_%d%s)",
	         c->arch, ptx ? " with PTX" : ", without PTX", dev_arch, c->arch / 10, c->arch,
	         ptx ? ", the PTX on newer GPUs" : "");
	return KL_EUNSUPPORTED;
}
