/* cache.c - kiln's disk cache: a private directory of content-keyed entries.
 * Every entry carries a header (magic, format, key, length, checksum) and is
 * written to a unique temp file, fsync'd and renamed into place, so readers
 * see a whole entry or none; a damaged entry is reported and rebuilt.
 */
#include <dirent.h>
#include <pthread.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/le.h"
#include "runtime/runtime_int.h"

#define ENTRY_MAGIC "KILNCACH"
#define ENTRY_FORMAT 1u
#define ENTRY_HEADER 48u
#define ENTRY_MAX_PAYLOAD ((uint64_t)1 << 32)

/* mkdir -p, creating missing components private to us. */
static bool make_dirs(char *path)
{
	size_t len = strlen(path);
	for (size_t i = 1; i <= len; i++) {
		if (path[i] != '/' && path[i] != '\0')
			continue;
		char c = path[i];
		path[i] = '\0';
		if (mkdir(path, 0700) != 0 && errno != EEXIST) {
			path[i] = c;
			return false;
		}
		path[i] = c;
	}
	return true;
}

int kl__cache_fail_writes;

/* The first time writing into a cache directory fails, say so on stderr:
 * compiling goes on without the cache (slower starts), which a user should
 * know about. Once per directory and process. */
static void warn_unwritable(const char *dir, const char *what, int err)
{
	static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
	static char last[PATH_MAX];
	pthread_mutex_lock(&mu);
	bool fresh = strcmp(last, dir) != 0;
	if (fresh) {
		snprintf(last, sizeof last, "%s", dir);
		fprintf(stderr,
		        "kiln: warning: the cache directory %s is not writable (%s: %s); "
		        "compiling without the disk cache\n",
		        dir, what, strerror(err));
		fflush(stderr);
	}
	pthread_mutex_unlock(&mu);
}

bool kl__cache_dir(const kl_ctx *ctx, char *buf, size_t cap)
{
	const char *env = getenv("KILN_CACHE_DIR"), *xdg = getenv("XDG_CACHE_HOME");
	const char *home = getenv("HOME");
	int n;
	if (env && *env)
		n = snprintf(buf, cap, "%s%s", env[0] == '-' ? "./" : "", env);
	else if (xdg && xdg[0] == '/') /* the XDG spec ignores relative values */
		n = snprintf(buf, cap, "%s/kiln", xdg);
	else if (home && home[0] == '/')
		n = snprintf(buf, cap, "%s/.cache/kiln", home);
	else {
		kl__log(ctx, KL_LOG_CACHE,
		        "no cache directory (KILN_CACHE_DIR, XDG_CACHE_HOME and "
		        "HOME unset): not caching on disk");
		return false;
	}
	if (n <= 0 || (size_t)n >= cap - 64) {
		kl__log(ctx, KL_LOG_CACHE, "cache directory path too long: not caching on disk");
		return false;
	}
	while (n > 1 && buf[n - 1] == '/')
		buf[--n] = '\0';
	if (!make_dirs(buf)) {
		int e = errno;
		kl__log(ctx, KL_LOG_CACHE, "cannot create %s: %s: not caching on disk", buf,
		        strerror(e));
		warn_unwritable(buf, "cannot create it", e);
		return false;
	}
	/* We dlopen code from here: it must be ours and closed to others. */
	struct stat st;
	if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode)) {
		kl__log(ctx, KL_LOG_CACHE, "%s is not a directory: not caching on disk", buf);
		return false;
	}
	if (st.st_uid != geteuid() || (st.st_mode & 022)) {
		/* Said once a process on stderr, whatever KILN_LOGS says: a cache
		 * that silently never fills costs every run its compiles. */
		static atomic_flag warned = ATOMIC_FLAG_INIT;
		const char *why = st.st_uid != geteuid() ? "is owned by another user"
		                  : (st.st_mode & 002)   ? "is writable by others"
		                                         : "is writable by its group";
		if (!atomic_flag_test_and_set(&warned))
			fprintf(stderr,
			        "kiln: warning: not caching compiled code on disk: %s %s (owner "
			        "%ld, mode %03o), and kiln loads code from it; make it private "
			        "(chmod go-w) or set KILN_CACHE_DIR to a directory of your own\n",
			        buf, why, (long)st.st_uid, (unsigned)(st.st_mode & 0777));
		kl__log(ctx, KL_LOG_CACHE, "%s %s (owner %ld, mode %03o): not caching on disk",
		        buf, why, (long)st.st_uid, (unsigned)(st.st_mode & 0777));
		return false;
	}
	return true;
}

kl_status kl__cache_workdir(kl_ctx *ctx, const char *cachedir, char *buf, size_t cap)
{
	const char *tmp = getenv("TMPDIR");
	int n = snprintf(buf, cap, "%s/kiln-build-XXXXXX", tmp && tmp[0] == '/' ? tmp : "/tmp");
	if (n > 0 && (size_t)n < cap && mkdtemp(buf))
		return KL_OK;
	int e = n > 0 && (size_t)n < cap ? errno : ENAMETOOLONG;
	/* no room in the temp dir: the cache directory is private too */
	if (cachedir) {
		n = snprintf(buf, cap, "%s/.build-XXXXXX", cachedir);
		if (n > 0 && (size_t)n < cap && mkdtemp(buf))
			return KL_OK;
	}
	return kl__err(ctx, KL_EIO, "kl_compile: cannot create a build directory in %s: %s",
	               tmp && tmp[0] == '/' ? tmp : "/tmp", strerror(e));
}

void kl__rmtree_flat(const char *dir)
{
	DIR *d = opendir(dir);
	if (d) {
		struct dirent *e;
		char p[PATH_MAX];
		while ((e = readdir(d))) {
			if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
				continue;
			if (snprintf(p, sizeof p, "%s/%s", dir, e->d_name) < (int)sizeof p)
				unlink(p);
		}
		closedir(d);
	}
	rmdir(dir);
}

static bool read_all(int fd, void *buf, size_t n)
{
	size_t done = 0;
	while (done < n) {
		ssize_t r = read(fd, (char *)buf + done, n - done);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return false;
		done += (size_t)r;
	}
	return true;
}

static bool write_all(int fd, const void *buf, size_t n)
{
	size_t done = 0;
	while (done < n) {
		ssize_t w = write(fd, (const char *)buf + done, n - done);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return false;
		done += (size_t)w;
	}
	return true;
}

/* Open a file from outside for reading without ever blocking: O_NONBLOCK so
 * that a FIFO (or a device) planted at the name cannot hang open(), then
 * fstat, and only a regular file is kept (O_NONBLOCK is cleared again).
 * -1 with errno set and *why saying what was refused. */
static int open_regular(const char *path, const char **why)
{
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	struct stat st;
	if (fd < 0) {
		*why = strerror(errno);
		return -1;
	}
	int fl = fcntl(fd, F_GETFL);
	if (fstat(fd, &st) != 0 || fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
		int e = errno;
		*why = strerror(e);
		close(fd);
		errno = e;
		return -1;
	}
	if (!S_ISREG(st.st_mode)) {
		*why = S_ISFIFO(st.st_mode)  ? "a FIFO, not a regular file"
		       : S_ISDIR(st.st_mode) ? "a directory, not a regular file"
		                             : "not a regular file";
		close(fd);
		errno = EINVAL;
		return -1;
	}
	return fd;
}

kl_status kl__cache_get(const kl_ctx *ctx, const char *dir, const char *name, uint64_t key,
                        void **payload, size_t *len)
{
	char path[PATH_MAX];
	*payload = NULL;
	*len = 0;
	if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path)
		return KL_EIO;
	const char *why = NULL;
	int fd = open_regular(path, &why);
	if (fd < 0) {
		if (errno != ENOENT)
			kl__log(ctx, KL_LOG_CACHE, "entry %s unreadable (%s): rebuilding", name, why);
		return KL_EIO;
	}
	why = NULL;
	uint8_t h[ENTRY_HEADER];
	struct stat st;
	uint8_t *data = NULL;
	uint64_t plen = 0;
	if (fstat(fd, &st) != 0)
		why = "cannot stat";
	else if ((uint64_t)st.st_size < ENTRY_HEADER || !read_all(fd, h, ENTRY_HEADER))
		why = "truncated header";
	else if (memcmp(h, ENTRY_MAGIC, 8) != 0)
		why = "bad magic";
	else if (kl__le_get32(h + 8) != ENTRY_FORMAT || kl__le_get32(h + 12) != ENTRY_HEADER)
		why = "unknown format version";
	else if (kl__le_get64(h + 40) != kl__hash_bytes(KL_HASH_SEED, h, 40))
		why = "header checksum mismatch";
	else if (kl__le_get64(h + 16) != key)
		why = "key mismatch";
	else if ((plen = kl__le_get64(h + 24)) > ENTRY_MAX_PAYLOAD)
		why = "implausible length";
	else if ((uint64_t)st.st_size - ENTRY_HEADER < plen)
		why = "truncated";
	else if ((uint64_t)st.st_size - ENTRY_HEADER > plen)
		why = "trailing bytes";
	else if (!(data = malloc(plen ? plen : 1)))
		why = "out of memory";
	else if (!read_all(fd, data, plen))
		why = "truncated";
	else if (kl__hash_bytes(KL_HASH_SEED, data, plen) != kl__le_get64(h + 32))
		why = "checksum mismatch";
	close(fd);
	if (why) {
		free(data);
		kl__log(ctx, KL_LOG_CACHE, "entry %s corrupt (%s): rebuilding", name, why);
		return KL_EFORMAT;
	}
	*payload = data;
	*len = plen;
	return KL_OK;
}

static void fsync_dir(const char *path)
{
	char dir[PATH_MAX];
	snprintf(dir, sizeof dir, "%s", path);
	char *slash = strrchr(dir, '/');
	if (!slash)
		snprintf(dir, sizeof dir, ".");
	else if (slash == dir)
		dir[1] = '\0';
	else
		*slash = '\0';
	int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC);
	if (fd >= 0) {
		fsync(fd);
		close(fd);
	}
}

/* dir/name made of a then b, atomically: a unique temp file, fsync, rename. */
static kl_status write_atomic(kl_ctx *ctx, const char *dir, const char *name, const void *a,
                              size_t an, const void *b, size_t bn)
{
	char tmp[PATH_MAX], path[PATH_MAX];
	if (snprintf(tmp, sizeof tmp, "%s/.tmp-XXXXXX", dir) >= (int)sizeof tmp ||
	    snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path)
		return KL_EIO;
	const char *what = "cannot create a file";
	int fd = -1, e = kl__cache_fail_writes;
	if (!e && (fd = mkstemp(tmp)) < 0)
		e = errno;
	if (fd >= 0) {
		what = "cannot write a file";
		if (!write_all(fd, a, an) || !write_all(fd, b, bn) || fsync(fd) != 0)
			e = errno ? errno : EIO;
		if (close(fd) != 0 && !e)
			e = errno;
		if (!e && rename(tmp, path) != 0) {
			what = "cannot rename a file";
			e = errno;
		}
		if (e)
			unlink(tmp);
	}
	if (e) {
		kl__log(ctx, KL_LOG_CACHE, "cannot write entry %s: %s", name, strerror(e));
		warn_unwritable(dir, what, e);
		return KL_EIO;
	}
	fsync_dir(path);
	kl__log(ctx, KL_LOG_CACHE, "wrote %s (%zu bytes)", name, an + bn);
	return KL_OK;
}

kl_status kl__cache_put(kl_ctx *ctx, const char *dir, const char *name, uint64_t key,
                        const void *payload, size_t len)
{
	uint8_t h[ENTRY_HEADER];
	memcpy(h, ENTRY_MAGIC, 8);
	kl__le_put32(h + 8, ENTRY_FORMAT);
	kl__le_put32(h + 12, ENTRY_HEADER);
	kl__le_put64(h + 16, key);
	kl__le_put64(h + 24, (uint64_t)len);
	kl__le_put64(h + 32, kl__hash_bytes(KL_HASH_SEED, payload, len));
	kl__le_put64(h + 40, kl__hash_bytes(KL_HASH_SEED, h, 40));
	return write_atomic(ctx, dir, name, h, sizeof h, payload, len);
}

kl_status kl__cache_put_file(kl_ctx *ctx, const char *dir, const char *name, const char *src,
                             uint64_t size)
{
	const char *why;
	int fd = open_regular(src, &why);
	if (fd < 0)
		return KL_EIO;
	uint8_t *bytes = size <= SIZE_MAX ? malloc(size ? (size_t)size : 1) : NULL;
	bool ok = bytes && read_all(fd, bytes, (size_t)size);
	close(fd);
	kl_status st = ok ? write_atomic(ctx, dir, name, bytes, (size_t)size, NULL, 0) : KL_EIO;
	free(bytes);
	return st;
}

kl_status kl__file_digest(const char *path, uint64_t *hash, uint64_t *size)
{
	const char *why;
	int fd = open_regular(path, &why);
	if (fd < 0)
		return KL_EIO;
	uint64_t h = KL_HASH_SEED, n = 0;
	uint8_t buf[1 << 15];
	for (;;) {
		ssize_t r = read(fd, buf, sizeof buf);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			close(fd);
			return KL_EIO;
		}
		if (r == 0)
			break;
		h = kl__hash_bytes(h, buf, (size_t)r);
		n += (uint64_t)r;
	}
	close(fd);
	*hash = h;
	*size = n;
	return KL_OK;
}

kl_status kl__file_read(const char *path, uint8_t **bytes, size_t *len)
{
	const char *why;
	*bytes = NULL;
	*len = 0;
	int fd = open_regular(path, &why);
	if (fd < 0)
		return KL_EIO;
	struct stat st;
	uint8_t *b = NULL;
	bool ok = fstat(fd, &st) == 0 && st.st_size >= 0 && (uint64_t)st.st_size <= SIZE_MAX / 2 &&
	          (b = malloc(st.st_size ? (size_t)st.st_size : 1)) &&
	          read_all(fd, b, (size_t)st.st_size);
	close(fd);
	if (!ok) {
		free(b);
		return KL_EIO;
	}
	*bytes = b;
	*len = (size_t)st.st_size;
	return KL_OK;
}
