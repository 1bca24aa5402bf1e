/*
 * A stand-in for libcuda.so.1 on a machine without a GPU, for the tests of repro.c and
 * envelope.py: "device" memory is host memory, the batch call copies with memcpy, and a
 * few environment variables make it misbehave the ways a driver can:
 *
 *   FAKE_CUDA_FAULT_ABOVE=N   a batch of more than N descriptors of mixed sizes raises SIGSEGV
 *   FAKE_CUDA_HANG_ABOVE=N    a batch of more than N descriptors of one size never returns
 *   FAKE_CUDA_BATCH_RC=N      the batch call returns N
 *   FAKE_CUDA_CORRUPT=1       one byte of the first block is copied wrong
 *   FAKE_CUDA_SPILL=1         one byte after the first block is overwritten
 *
 *   cc -shared -fPIC -I$CUDA_HOME/include -o libcuda.so.1 fake_libcuda.c
 */
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>

static long env_long(const char *name, long otherwise) {
    const char *v = getenv(name);
    return v && *v ? atol(v) : otherwise;
}

static CUresult ok_init(unsigned f) { (void)f; return CUDA_SUCCESS; }
static CUresult version(int *v) { *v = 13000; return CUDA_SUCCESS; }
static CUresult device_get(CUdevice *d, int i) { *d = i; return CUDA_SUCCESS; }
static CUresult device_name(char *n, int len, CUdevice d) { (void)d; strncpy(n, "fake device", (size_t)len); return CUDA_SUCCESS; }
static CUresult retain(CUcontext *c, CUdevice d) { (void)d; *c = (CUcontext)(uintptr_t)0x1000; return CUDA_SUCCESS; }
static CUresult set_current(CUcontext c) { (void)c; return CUDA_SUCCESS; }
static CUresult stream_create(CUstream *s, unsigned f) { (void)f; *s = (CUstream)(uintptr_t)0x2000; return CUDA_SUCCESS; }
static CUresult stream_sync(CUstream s) { (void)s; return CUDA_SUCCESS; }
static CUresult host_alloc(void **p, size_t n, unsigned f) { (void)f; *p = malloc(n); return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY; }
static CUresult mem_alloc(CUdeviceptr *p, size_t n) { void *m = malloc(n); *p = (CUdeviceptr)(uintptr_t)m; return m ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY; }
static CUresult htod(CUdeviceptr d, const void *s, size_t n) { memcpy((void *)(uintptr_t)d, s, n); return CUDA_SUCCESS; }
static CUresult dtoh(void *d, CUdeviceptr s, size_t n) { memcpy(d, (const void *)(uintptr_t)s, n); return CUDA_SUCCESS; }
static CUresult memset8(CUdeviceptr d, unsigned char v, size_t n) { memset((void *)(uintptr_t)d, v, n); return CUDA_SUCCESS; }
static CUresult ctx_sync(void) { return CUDA_SUCCESS; }

static CUresult error_name(CUresult rc, const char **name) {
    *name = rc == CUDA_ERROR_INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

static CUresult batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count) {
    long rc = env_long("FAKE_CUDA_BATCH_RC", 0);
    if (rc) return (CUresult)rc;
    int mixed = 0;
    for (size_t i = 1; i < count; i++) mixed |= sizes[i] != sizes[0];
    long fault = env_long("FAKE_CUDA_FAULT_ABOVE", -1), hang = env_long("FAKE_CUDA_HANG_ABOVE", -1);
    if (mixed && fault >= 0 && (long)count > fault) raise(SIGSEGV);
    if (!mixed && hang >= 0 && (long)count > hang) for (;;) pause();
    for (size_t i = 0; i < count; i++) memcpy((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i]);
    if (env_long("FAKE_CUDA_CORRUPT", 0)) *(unsigned char *)(uintptr_t)dsts[0] ^= 0xFF;
    if (env_long("FAKE_CUDA_SPILL", 0)) *((unsigned char *)(uintptr_t)dsts[0] + sizes[0]) ^= 0xFF;
    return CUDA_SUCCESS;
}

static CUresult batch12080(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t c, CUmemcpyAttributes *a, size_t *ai,
                           size_t na, size_t *fail, CUstream st) {
    (void)a; (void)ai; (void)na; (void)st;
    *fail = (size_t)-1;
    return batch(d, s, n, c);
}

CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t c, CUmemcpyAttributes *a, size_t *ai,
                               size_t na, CUstream st) {
    (void)a; (void)ai; (void)na; (void)st;
    return batch(d, s, n, c);
}

static const struct { const char *name; void *fn; } PROCS[] = {
    {"cuInit", (void *)ok_init}, {"cuDriverGetVersion", (void *)version}, {"cuDeviceGet", (void *)device_get},
    {"cuDeviceGetName", (void *)device_name}, {"cuDevicePrimaryCtxRetain", (void *)retain},
    {"cuCtxSetCurrent", (void *)set_current}, {"cuStreamCreate", (void *)stream_create},
    {"cuStreamSynchronize", (void *)stream_sync}, {"cuMemHostAlloc", (void *)host_alloc},
    {"cuMemAlloc", (void *)mem_alloc}, {"cuMemcpyHtoD", (void *)htod}, {"cuMemcpyDtoH", (void *)dtoh},
    {"cuMemsetD8", (void *)memset8}, {"cuGetErrorName", (void *)error_name},
    {"cuCtxSynchronize", (void *)ctx_sync},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int v, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *found) {
    (void)flags;
    *pfn = NULL;
    *found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (strcmp(symbol, "cuMemcpyBatchAsync") == 0)
        *pfn = v >= 13000 ? (void *)cuMemcpyBatchAsync_v2 : (void *)batch12080;
    for (size_t i = 0; *pfn == NULL && i < sizeof PROCS / sizeof PROCS[0]; i++)
        if (strcmp(symbol, PROCS[i].name) == 0) *pfn = PROCS[i].fn;
    if (*pfn) *found = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}
