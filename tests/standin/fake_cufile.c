/* A stand-in for libcufile, for tests on machines without a GPU: "device memory" is
 * host memory (as in fake_cuda.c), and cuFileRead is a pread loop into it. It checks
 * stoker's decisions and fallbacks (driver properties, failed reads), never GPUDirect
 * Storage itself; passing tests against it are not GPU verification.
 *
 * Environment, read when the library is loaded:
 *   FAKE_CUFILE_NVFS=1         the nvidia-fs driver is "loaded": major version 2 and
 *                              the NVMe bit in dstatusflags (otherwise version 0 and no
 *                              flags: cuFile would run in its POSIX compatibility mode)
 *   FAKE_CUFILE_P2P=1          dstatusflags also reports NVMe PCI P2PDMA
 *   FAKE_CUFILE_OPEN_FAIL=1    cuFileDriverOpen fails with 5001 (driver not initialised)
 *   FAKE_CUFILE_FAIL_READ_AT=N the N-th cuFileRead call (1-based, all threads) returns -EIO
 * Test hooks: fake_cufile_reads(), fake_cufile_last_flags(), fake_cufile_fail_read_at(). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef struct { int err, cu_err; } CUfileError_t; /* err: 0 or 5000 + n */

enum { SUCCESS = 0, DRIVER_NOT_INITIALIZED = 5001, INVALID_FILE_TYPE = 5018, INVALID_VALUE = 5022 };
enum { NVME_SUPPORTED = 1u << 4, NVME_P2P_SUPPORTED = 1u << 11, ALLOW_COMPAT_MODE = 1u << 1 };

typedef struct {
    struct {
        unsigned major_version, minor_version;
        size_t poll_thresh_size, max_direct_io_size;
        unsigned dstatusflags, dcontrolflags;
    } nvfs;
    unsigned fflags, max_device_cache_size, per_buffer_cache_size, max_device_pinned_mem_size,
        max_batch_io_size, max_batch_io_timeout_msecs;
} CUfileDrvProps_t;

typedef struct {
    int type; /* 1: a Linux fd */
    union { int fd; void *handle; } handle;
    const void *fs_ops;
} CUfileDescr_t;

/* A registered file. `fd` is a descriptor of our own, opened through /proc without
 * O_DIRECT, so reads into unaligned host buffers work as cuFile's own bounce does. */
struct handle { int fd; };

static int g_nvfs, g_p2p, g_open_fail, g_open;
static uint64_t g_reads, g_fail_at;
static int g_last_flags = -1;

static int env_is(const char *name, const char *value) {
    const char *v = getenv(name);
    return v && strcmp(v, value) == 0;
}

__attribute__((constructor)) static void fake_cufile_load(void) {
    g_nvfs = env_is("FAKE_CUFILE_NVFS", "1");
    g_p2p = env_is("FAKE_CUFILE_P2P", "1");
    g_open_fail = env_is("FAKE_CUFILE_OPEN_FAIL", "1");
    const char *at = getenv("FAKE_CUFILE_FAIL_READ_AT");
    if (at) g_fail_at = strtoull(at, NULL, 10);
}

static CUfileError_t status(int err) { return (CUfileError_t){err, 0}; }
static int opened(void) { return __atomic_load_n(&g_open, __ATOMIC_SEQ_CST); }

uint64_t fake_cufile_reads(void) { return __atomic_load_n(&g_reads, __ATOMIC_SEQ_CST); }
int fake_cufile_last_flags(void) { return __atomic_load_n(&g_last_flags, __ATOMIC_SEQ_CST); }
/* Make the n-th cuFileRead call, counted from the start of the process, fail (0: none). */
void fake_cufile_fail_read_at(uint64_t n) { __atomic_store_n(&g_fail_at, n, __ATOMIC_SEQ_CST); }

CUfileError_t cuFileDriverOpen(void) {
    if (g_open_fail) return status(DRIVER_NOT_INITIALIZED);
    __atomic_store_n(&g_open, 1, __ATOMIC_SEQ_CST);
    return status(SUCCESS);
}

CUfileError_t cuFileDriverClose_v2(void) {
    __atomic_store_n(&g_open, 0, __ATOMIC_SEQ_CST);
    return status(SUCCESS);
}

CUfileError_t cuFileDriverClose(void) { return cuFileDriverClose_v2(); }

CUfileError_t cuFileGetVersion(int *version) {
    if (!version) return status(INVALID_VALUE);
    *version = 1150;
    return status(SUCCESS);
}

CUfileError_t cuFileDriverGetProperties(CUfileDrvProps_t *p) {
    if (!opened()) return status(DRIVER_NOT_INITIALIZED);
    if (!p) return status(INVALID_VALUE);
    memset(p, 0, sizeof *p);
    p->nvfs.major_version = g_nvfs ? 2 : 0;
    p->nvfs.minor_version = g_nvfs ? 17 : 0;
    p->nvfs.poll_thresh_size = 4;        /* KiB, as cufile.json has them */
    p->nvfs.max_direct_io_size = 16384;
    p->nvfs.dstatusflags = (g_nvfs ? NVME_SUPPORTED : 0) | (g_p2p ? NVME_P2P_SUPPORTED : 0);
    p->nvfs.dcontrolflags = ALLOW_COMPAT_MODE;
    p->max_device_cache_size = 131072;
    p->per_buffer_cache_size = 1024;
    p->max_device_pinned_mem_size = 33554432;
    p->max_batch_io_size = 128;
    p->max_batch_io_timeout_msecs = 5;
    return status(SUCCESS);
}

/* Boolean parameters: compatibility mode allowed, nothing else set. */
CUfileError_t cuFileGetParameterBool(int param, bool *value) {
    if (!value || param < 0) return status(INVALID_VALUE);
    *value = param == 1; /* CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE */
    return status(SUCCESS);
}

CUfileError_t cuFileHandleRegister(void **fh, CUfileDescr_t *descr) {
    if (!opened()) return status(DRIVER_NOT_INITIALIZED);
    if (!fh || !descr) return status(INVALID_VALUE);
    if (descr->type != 1) return status(INVALID_FILE_TYPE);
    int flags = fcntl(descr->handle.fd, F_GETFL);
    if (flags < 0) return status(INVALID_VALUE);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", descr->handle.fd);
    struct handle *h = malloc(sizeof *h);
    if (!h) return status(INVALID_VALUE);
    h->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (h->fd < 0) {
        free(h);
        return status(INVALID_VALUE);
    }
    __atomic_store_n(&g_last_flags, flags, __ATOMIC_SEQ_CST);
    *fh = h;
    return status(SUCCESS);
}

void cuFileHandleDeregister(void *fh) {
    struct handle *h = fh;
    if (!h) return;
    close(h->fd);
    free(h);
}

CUfileError_t cuFileBufRegister(const void *base, size_t length, int flags) {
    (void)length, (void)flags;
    if (!opened()) return status(DRIVER_NOT_INITIALIZED);
    return status(base ? SUCCESS : INVALID_VALUE);
}

CUfileError_t cuFileBufDeregister(const void *base) {
    if (!opened()) return status(DRIVER_NOT_INITIALIZED);
    return status(base ? SUCCESS : INVALID_VALUE);
}

/* Reads until `size` bytes or end of file; returns the bytes read, or -errno. */
ssize_t cuFileRead(void *fh, void *base, size_t size, off_t file_offset, off_t base_offset) {
    uint64_t call = __atomic_add_fetch(&g_reads, 1, __ATOMIC_SEQ_CST);
    if (!opened()) return -DRIVER_NOT_INITIALIZED;
    if (!fh || !base || file_offset < 0 || base_offset < 0) return -EINVAL;
    if (call == __atomic_load_n(&g_fail_at, __ATOMIC_SEQ_CST)) return -EIO;
    struct handle *h = fh;
    char *dst = (char *)base + base_offset;
    size_t done = 0;
    while (done < size) {
        ssize_t n = pread(h->fd, dst + done, size - done, file_offset + (off_t)done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -errno;
        if (n == 0) break;
        done += (size_t)n;
    }
    return (ssize_t)done;
}
