/*
 * One cuMemcpyBatchAsync call of N scattered descriptors, and a check of every byte.
 *
 * A pool of random bytes on the source side (page-locked host memory from cuMemHostAlloc,
 * or device memory from cuMemAlloc) and a poisoned pool on the destination side; N blocks
 * placed in a random order on each side, each block at an address of the asked alignment,
 * random gaps between them. One batch call copies them all (one attribute for every copy,
 * as an engine passes it), the stream is synchronised, and then every byte of the
 * destination pool is checked: each block equals its source, every byte between and after
 * the blocks still holds the poison.
 *
 * Only the CUDA driver API, no runtime and no Python. libcuda is opened with dlopen and
 * every entry point is looked up with cuGetProcAddress, so the binary needs only cuda.h
 * to build and picks the batch call's ABI at run time:
 *
 *   nvcc -O2 -o repro repro.c -ldl        (or: cc -O2 -I$CUDA_HOME/include repro.c -ldl)
 *   ./repro -n 200000 -s m1-4096 -a odd -d h2d
 *
 * Options:
 *   -n COUNT   descriptors in the call (default 50000)
 *   -s SIZES   uNNN: every block NNN bytes; mLO-HI: sizes drawn uniformly from [LO, HI]
 *              (default m1-4096)
 *   -a ALIGN   odd: every address odd; N: every address a multiple of N (default odd)
 *   -d DIR     h2d, d2h or d2d (default h2d)
 *   -o ORDER   srcAccessOrder: any, stream or during (default: any for h2d, stream otherwise,
 *              as an engine that knows its host source is not written by the GPU does)
 *   -b ABI     the batch entry point: 12080 (cuGetProcAddress at CUDA 12.8: failIdx form),
 *              13000 (at CUDA 13.0: no failIdx) or export (the exported cuMemcpyBatchAsync_v2)
 *              (default: 13000 on a CUDA 13 driver, else 12080)
 *   -g GAP     largest gap between blocks in bytes (default: HI for mixed sizes; for one
 *              size, a gap of 0 or one block)
 *   -c CALLS   calls of the same batch (default 1); each is checked
 *   -r SEED    random seed (default 1)
 *   -D INDEX   device ordinal (default 0)
 *
 * Prints one JSON line on stdout. Exit status: 0 copied and verified; 1 usage; 2 set-up
 * failed (driver, allocation); 3 the batch call returned an error; 4 the stream reported
 * an error at synchronisation; 5 wrong bytes inside the copied blocks; 6 bytes outside the
 * blocks changed. A fault inside the driver ends the process by a signal.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda.h>

enum { OK = 0, USAGE = 1, SETUP = 2, CALL_ERROR = 3, STREAM_ERROR = 4, WRONG = 5, CANARY = 6 };

typedef CUresult (*GetProc)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*Batch12080)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
                               size_t, size_t *, CUstream);
typedef CUresult (*Batch13000)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
                               size_t, CUstream);

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DriverGetVersion)(int *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetName)(char *, int, CUdevice);
    CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*MemsetD8)(CUdeviceptr, unsigned char, size_t);
    CUresult (*CtxSynchronize)(void);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;

static GetProc get_proc;

static const char *err_name(CUresult rc) {
    const char *name = NULL;
    if (cu.GetErrorName == NULL || cu.GetErrorName(rc, &name) != CUDA_SUCCESS || name == NULL) return "unknown";
    return name;
}

static void *proc(const char *symbol, int version) {
    void *fn = NULL;
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = get_proc(symbol, &fn, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found);
    if (rc != CUDA_SUCCESS || fn == NULL || found != CU_GET_PROC_ADDRESS_SUCCESS) {
        fprintf(stderr, "repro: cuGetProcAddress(%s, %d) failed: rc %d, status %d\n", symbol, version, (int)rc,
                (int)found);
        exit(SETUP);
    }
    return fn;
}

static void check(CUresult rc, const char *what) {
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "repro: %s failed: %s (%d)\n", what, err_name(rc), (int)rc);
        exit(SETUP);
    }
}

/* splitmix64: fast, seedable, good enough to make every byte of a pool differ. */
static uint64_t next_u64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t below(uint64_t *s, uint64_t n) { return n ? next_u64(s) % n : 0; }

static void fill_random(unsigned char *p, size_t n, uint64_t *s) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = next_u64(s);
        memcpy(p + i, &v, 8);
    }
    for (; i < n; i++) p[i] = (unsigned char)next_u64(s);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Places the blocks on one side in the random order `order`: each start has the asked
 * alignment (odd: 2k + 1), with a random gap after each block. Returns the pool size. */
static size_t place(const size_t *sizes, const size_t *order, size_t n, size_t align, int odd, size_t max_gap,
                    int gap_is_block, size_t *offsets, uint64_t *rng) {
    size_t pos = 0;
    for (size_t k = 0; k < n; k++) {
        size_t i = order[k];
        if (odd) pos = (pos | 1u);
        else pos = (pos + align - 1) / align * align;
        offsets[i] = pos;
        pos += sizes[i];
        pos += gap_is_block ? (below(rng, 2) ? sizes[i] : 0) : below(rng, max_gap + 1);
    }
    return pos + 256;
}

static void shuffle(size_t *a, size_t n, uint64_t *rng) {
    for (size_t i = 0; i < n; i++) a[i] = i;
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)below(rng, i);
        size_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

static int usage(const char *why) {
    fprintf(stderr, "repro: %s\nusage: repro [-n COUNT] [-s uNNN|mLO-HI] [-a odd|N] [-d h2d|d2h|d2d] "
                    "[-o any|stream|during] [-b 12080|13000|export] [-g GAP] [-c CALLS] [-r SEED] [-D INDEX]\n",
            why);
    return USAGE;
}

int main(int argc, char **argv) {
    size_t n = 50000, lo = 1, hi = 4096, align = 1, max_gap = 0, calls = 1;
    int odd = 1, uniform = 0, gap_given = 0, device_ordinal = 0, order = 0;
    const char *dir = "h2d", *abi_arg = NULL;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (a[0] != '-' || a[1] == 0 || a[2] != 0 || v == NULL) return usage("each option takes a value");
        i++;
        switch (a[1]) {
        case 'n': n = strtoull(v, NULL, 10); break;
        case 's':
            if (v[0] == 'u') { uniform = 1; lo = hi = strtoull(v + 1, NULL, 10); }
            else if (v[0] == 'm' && sscanf(v + 1, "%zu-%zu", &lo, &hi) == 2) uniform = 0;
            else return usage("-s takes uNNN or mLO-HI");
            break;
        case 'a':
            if (strcmp(v, "odd") == 0) { odd = 1; align = 2; }
            else { odd = 0; align = strtoull(v, NULL, 10); }
            break;
        case 'd': dir = v; break;
        case 'o':
            order = strcmp(v, "any") == 0 ? CU_MEMCPY_SRC_ACCESS_ORDER_ANY
                  : strcmp(v, "stream") == 0 ? CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                  : strcmp(v, "during") == 0 ? CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL : -1;
            if (order < 0) return usage("-o takes any, stream or during");
            break;
        case 'b': abi_arg = v; break;
        case 'g': max_gap = strtoull(v, NULL, 10); gap_given = 1; break;
        case 'c': calls = strtoull(v, NULL, 10); break;
        case 'r': seed = strtoull(v, NULL, 10); break;
        case 'D': device_ordinal = atoi(v); break;
        default: return usage("unknown option");
        }
    }
    int h2d = strcmp(dir, "h2d") == 0, d2h = strcmp(dir, "d2h") == 0, d2d = strcmp(dir, "d2d") == 0;
    if (!(h2d || d2h || d2d)) return usage("-d takes h2d, d2h or d2d");
    if (n == 0 || lo == 0 || hi < lo || align == 0 || calls == 0) return usage("counts, sizes and alignment must be >= 1");
    if (!gap_given) max_gap = hi;
    if (order == 0) order = h2d ? CU_MEMCPY_SRC_ACCESS_ORDER_ANY : CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;

    /* -- the driver ------------------------------------------------------------------ */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "repro: cannot open libcuda.so.1: %s\n", dlerror());
        return SETUP;
    }
    get_proc = (GetProc)dlsym(lib, "cuGetProcAddress_v2");
    if (get_proc == NULL) {
        fprintf(stderr, "repro: libcuda has no cuGetProcAddress_v2 (a driver older than CUDA 12.0)\n");
        return SETUP;
    }
    cu.GetErrorName = proc("cuGetErrorName", 6000);
    cu.Init = proc("cuInit", 2000);
    check(cu.Init(0), "cuInit");
    cu.DriverGetVersion = proc("cuDriverGetVersion", 2020);
    int version = 0;
    check(cu.DriverGetVersion(&version), "cuDriverGetVersion");
    if (version < 12080) {
        fprintf(stderr, "repro: driver supports CUDA %d.%d; cuMemcpyBatchAsync needs 12.8\n", version / 1000,
                version % 1000 / 10);
        return SETUP;
    }
    cu.DeviceGet = proc("cuDeviceGet", 2000);
    cu.DeviceGetName = proc("cuDeviceGetName", 2000);
    cu.PrimaryCtxRetain = proc("cuDevicePrimaryCtxRetain", 7000);
    cu.CtxSetCurrent = proc("cuCtxSetCurrent", 4000);
    cu.StreamCreate = proc("cuStreamCreate", 2000);
    cu.StreamSynchronize = proc("cuStreamSynchronize", 2000);
    cu.MemHostAlloc = proc("cuMemHostAlloc", 3020);
    cu.MemAlloc = proc("cuMemAlloc", 3020);
    cu.MemcpyHtoD = proc("cuMemcpyHtoD", 3020);
    cu.MemcpyDtoH = proc("cuMemcpyDtoH", 3020);
    cu.MemsetD8 = proc("cuMemsetD8", 3020);
    cu.CtxSynchronize = proc("cuCtxSynchronize", 2000);

    const char *abi = abi_arg ? abi_arg : (version >= 13000 ? "13000" : "12080");
    void *batch = NULL;
    if (strcmp(abi, "export") == 0) batch = dlsym(lib, "cuMemcpyBatchAsync_v2");
    else if (strcmp(abi, "12080") == 0 || strcmp(abi, "13000") == 0) batch = proc("cuMemcpyBatchAsync", atoi(abi));
    else return usage("-b takes 12080, 13000 or export");
    if (batch == NULL) {
        fprintf(stderr, "repro: no cuMemcpyBatchAsync for ABI %s\n", abi);
        return SETUP;
    }
    int fail_idx_form = strcmp(abi, "12080") == 0;

    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    char name[256] = {0};
    check(cu.DeviceGet(&dev, device_ordinal), "cuDeviceGet");
    check(cu.DeviceGetName(name, sizeof name - 1, dev), "cuDeviceGetName");
    check(cu.PrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cu.CtxSetCurrent(ctx), "cuCtxSetCurrent");
    check(cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");  /* the batch call rejects the legacy stream */

    /* -- the batch ------------------------------------------------------------------- */
    double t0 = now_s();
    uint64_t rng = seed * 0x2545F4914F6CDD1Dull + 7;
    size_t *sizes = malloc(n * sizeof *sizes), *so = malloc(n * sizeof *so), *dof = malloc(n * sizeof *dof);
    size_t *src_order = malloc(n * sizeof *src_order), *dst_order = malloc(n * sizeof *dst_order);
    CUdeviceptr *srcs = malloc(n * sizeof *srcs), *dsts = malloc(n * sizeof *dsts);
    if (!sizes || !so || !dof || !src_order || !dst_order || !srcs || !dsts) return SETUP;
    for (size_t i = 0; i < n; i++) sizes[i] = uniform ? lo : lo + (size_t)below(&rng, hi - lo + 1);
    shuffle(src_order, n, &rng);
    shuffle(dst_order, n, &rng);
    size_t src_bytes = place(sizes, src_order, n, align, odd, max_gap, uniform && !gap_given, so, &rng);
    size_t dst_bytes = place(sizes, dst_order, n, align, odd, max_gap, uniform && !gap_given, dof, &rng);
    unsigned char poison = (unsigned char)(0x5A ^ seed);

    /* Source: random bytes (a source of zeros did not fault); destination: poison. */
    unsigned char *data = NULL, *host_dst = NULL, *readback = NULL;
    CUdeviceptr dev_src = 0, dev_dst = 0;
    if (h2d) {
        check(cu.MemHostAlloc((void **)&data, src_bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc (source)");
    } else {
        data = malloc(src_bytes);
        if (!data) return SETUP;
        check(cu.MemAlloc(&dev_src, src_bytes), "cuMemAlloc (source)");
    }
    fill_random(data, src_bytes, &rng);
    if (!h2d) check(cu.MemcpyHtoD(dev_src, data, src_bytes), "cuMemcpyHtoD (source)");
    if (d2h) {
        check(cu.MemHostAlloc((void **)&host_dst, dst_bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc (destination)");
    } else {
        check(cu.MemAlloc(&dev_dst, dst_bytes), "cuMemAlloc (destination)");
        readback = malloc(dst_bytes);
        if (!readback) return SETUP;
    }
    CUdeviceptr src_base = h2d ? (CUdeviceptr)(uintptr_t)data : dev_src;
    CUdeviceptr dst_base = d2h ? (CUdeviceptr)(uintptr_t)host_dst : dev_dst;
    for (size_t i = 0; i < n; i++) {
        srcs[i] = src_base + so[i];
        dsts[i] = dst_base + dof[i];
    }
    CUmemcpyAttributes attr;
    memset(&attr, 0, sizeof attr);
    attr.srcAccessOrder = (CUmemcpySrcAccessOrder)order;
    size_t attr_idx = 0;
    double setup_s = now_s() - t0;

    int status = OK;
    size_t wrong = 0, canaries = 0, done_calls = 0, fail_idx = (size_t)-1;
    double call_us = 0, sync_ms = 0;
    CUresult rc = CUDA_SUCCESS;
    for (size_t c = 0; c < calls && status == OK; c++) {
        if (d2h) memset(host_dst, poison, dst_bytes);
        else {
            /* cuMemsetD8 on device memory returns before it is done, on the legacy stream, which a
             * non-blocking stream does not wait for: finish it before the call. */
            check(cu.MemsetD8(dev_dst, poison, dst_bytes), "cuMemsetD8");
            check(cu.CtxSynchronize(), "cuCtxSynchronize");
        }
        fprintf(stderr, "repro: call %zu: cuMemcpyBatchAsync(%zu descriptors, %s, %s, align %s, ABI %s)\n", c + 1, n,
                dir, uniform ? "one size" : "mixed sizes", odd ? "odd" : "N", abi);
        fflush(stderr);
        double t = now_s();
        if (fail_idx_form) rc = ((Batch12080)batch)(dsts, srcs, sizes, n, &attr, &attr_idx, 1, &fail_idx, stream);
        else rc = ((Batch13000)batch)(dsts, srcs, sizes, n, &attr, &attr_idx, 1, stream);
        call_us = 1e6 * (now_s() - t);
        if (rc != CUDA_SUCCESS) { status = CALL_ERROR; break; }
        t = now_s();
        rc = cu.StreamSynchronize(stream);
        sync_ms = 1e3 * (now_s() - t);
        if (rc != CUDA_SUCCESS) { status = STREAM_ERROR; break; }
        const unsigned char *got = host_dst;
        if (!d2h) {
            check(cu.MemcpyDtoH(readback, dev_dst, dst_bytes), "cuMemcpyDtoH (readback)");
            got = readback;
        }
        /* Walk the destination in placement order: gaps hold poison, blocks their source. */
        size_t pos = 0;
        for (size_t k = 0; k < n; k++) {
            size_t i = dst_order[k];
            for (; pos < dof[i]; pos++) canaries += got[pos] != poison;
            const unsigned char *want = data + so[i];
            if (memcmp(got + dof[i], want, sizes[i]) != 0)
                for (size_t b = 0; b < sizes[i]; b++) wrong += got[dof[i] + b] != want[b];
            pos = dof[i] + sizes[i];
        }
        for (; pos < dst_bytes; pos++) canaries += got[pos] != poison;
        done_calls++;
        if (wrong) status = WRONG;
        else if (canaries) status = CANARY;
    }
    char size_text[64], align_text[32];
    if (uniform) snprintf(size_text, sizeof size_text, "u%zu", lo);
    else snprintf(size_text, sizeof size_text, "m%zu-%zu", lo, hi);
    if (odd) snprintf(align_text, sizeof align_text, "odd");
    else snprintf(align_text, sizeof align_text, "%zu", align);
    printf("{\"device\": \"%s\", \"driver\": %d, \"abi\": \"%s\", \"direction\": \"%s\", \"count\": %zu, "
           "\"sizes\": \"%s\", \"align\": \"%s\", \"order\": %d, \"src_bytes\": %zu, "
           "\"dst_bytes\": %zu, \"calls\": %zu, \"status\": %d, \"result\": \"%s\", \"error\": \"%s\", "
           "\"fail_idx\": %lld, \"setup_s\": %.3f, \"call_us\": %.1f, \"sync_ms\": %.3f, \"wrong\": %zu, "
           "\"canaries\": %zu}\n",
           name, version, abi, dir, n, size_text, align_text, order, src_bytes,
           dst_bytes, done_calls, status,
           status == OK ? "ok" : status == CALL_ERROR ? "call error" : status == STREAM_ERROR ? "stream error"
           : status == WRONG ? "wrong bytes" : "canaries changed",
           rc == CUDA_SUCCESS ? "" : err_name(rc), fail_idx == (size_t)-1 ? -1LL : (long long)fail_idx, setup_s,
           call_us, sync_ms, wrong, canaries);
    return status;
}
