// The GPU's PCIe link to host memory, measured without the library: what the host-staged
// transport can reach at best. Each all-reduce on that transport moves its bytes both ways at
// once (ranks write their inputs into host memory while they read their peers'), so the figure
// that bounds it is the bandwidth of each direction while the other is busy too.
//
// Rows (S bytes per direction, REPS timed repetitions after one warm-up, median and spread):
//   ce-d2h, ce-h2d        one copy-engine copy (cudaMemcpyAsync) device -> host, host -> device
//   ce-both               both at once, on two streams
//   sm-store/G            a kernel of G blocks storing device data into mapped host memory
//   sm-load/G             a kernel of G blocks loading mapped host memory into device memory
//   sm-both/G             both kernels at once, on two streams (G blocks each)
//   ce-d2h+sm-load/G      copy-engine writes beside kernel loads (a hybrid staging design)
//   sm-store/G+ce-h2d     kernel stores beside copy-engine reads
// A row's GB/s is one direction's bytes over the time from the first start to the last end.
// The JSON also gives each row's wall-clock span (unix seconds, the timed repetitions from the
// first's start to the last's end) and its bytes per direction, so the rows of two processes
// run together can be summed over the union of their spans: per-repetition rates cannot be
// summed, since the repetitions of the two need not overlap.
// Usage: pcie_link [S_MiB=64] [REPS=10]; prints a table and, with JSON=path, writes JSON.
// ROWS=name,name,... runs only those rows. START_AT=unix seconds waits, after the allocations,
// until then: two processes started with the same START_AT (under MPS) run their rows at the
// same time, the traffic of a world-2 all-reduce through host memory on one GPU.
// HOST=memfd takes the host buffers from a memfd mapped shared and registered with the GPU
// (cudaHostRegister, mapped and portable), as the host-staged transport's slots are, instead of
// cudaHostAlloc: whether such memory moves as fast.
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                                                 \
    do {                                                                                      \
        cudaError_t e_ = (x);                                                                 \
        if (e_ != cudaSuccess) {                                                              \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

// Grid-stride copy of n 16-byte words, four in flight per thread before any store.
__global__ void copy16(uint4 *__restrict__ dst, const uint4 *__restrict__ src, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

struct Row {
    std::string name;
    double med, lo, hi;   // GB/s per direction
    double t_start, t_end; // wall clock, unix seconds: the timed repetitions' span
    double bytes;          // per direction, all timed repetitions
};

static double unix_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

static std::vector<Row> rows;

// One job: up to two operations started together on streams s0 and s1.
using Op = void (*)(cudaStream_t, void *);

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char **argv) {
    const size_t S = (size_t)(argc > 1 ? atoi(argv[1]) : 64) << 20;
    const int REPS = argc > 2 ? atoi(argv[2]) : 10;
    const size_t n16 = S / 16;
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("# %s, %d SMs, S = %zu MiB, %d reps\n", p.name, p.multiProcessorCount, S >> 20, REPS);

    void *h_out, *h_in, *d_src, *d_dst, *d_src2, *d_dst2;
    const char *host = getenv("HOST");
    if (host && strcmp(host, "memfd") == 0) {
        for (void **h : {&h_out, &h_in}) {
            const int fd = memfd_create("pcie_link", 0);
            if (fd < 0 || ftruncate(fd, (off_t)S) != 0) {
                perror("memfd");
                return 1;
            }
            *h = mmap(nullptr, S, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (*h == MAP_FAILED) {
                perror("mmap");
                return 1;
            }
            close(fd);
            CK(cudaHostRegister(*h, S, cudaHostRegisterMapped | cudaHostRegisterPortable));
        }
        printf("# host buffers: memfd, mmap shared, cudaHostRegister\n");
    } else {
        CK(cudaHostAlloc(&h_out, S, cudaHostAllocMapped | cudaHostAllocPortable));
        CK(cudaHostAlloc(&h_in, S, cudaHostAllocMapped | cudaHostAllocPortable));
    }
    memset(h_out, 1, S);
    memset(h_in, 2, S);
    CK(cudaMalloc(&d_src, S));
    CK(cudaMalloc(&d_dst, S));
    CK(cudaMalloc(&d_src2, S));
    CK(cudaMalloc(&d_dst2, S));
    CK(cudaMemset(d_src, 3, S));
    CK(cudaMemset(d_src2, 4, S));
    void *h_out_dev, *h_in_dev;
    CK(cudaHostGetDevicePointer(&h_out_dev, h_out, 0));
    CK(cudaHostGetDevicePointer(&h_in_dev, h_in, 0));

    cudaStream_t s0, s1;
    CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    cudaEvent_t start, e0, e1;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    // What each direction does, by kind: 'c' copy engine, 's' kernel of G blocks, 0 nothing.
    auto d2h = [&](char kind, int G, cudaStream_t s) {
        if (kind == 'c') CK(cudaMemcpyAsync(h_out, d_src, S, cudaMemcpyDeviceToHost, s));
        if (kind == 's') copy16<<<G, 512, 0, s>>>((uint4 *)h_out_dev, (const uint4 *)d_src, n16);
    };
    auto h2d = [&](char kind, int G, cudaStream_t s) {
        if (kind == 'c') CK(cudaMemcpyAsync(d_dst, h_in, S, cudaMemcpyHostToDevice, s));
        if (kind == 's') copy16<<<G, 512, 0, s>>>((uint4 *)d_dst, (const uint4 *)h_in_dev, n16);
    };
    const char *only = getenv("ROWS");
    auto run = [&](const std::string &name, char out_kind, char in_kind, int G) {
        if (only && ("," + std::string(only) + ",").find("," + name + ",") == std::string::npos) return;
        std::vector<double> gbps;
        double t_start = 0;
        for (int r = 0; r <= REPS; r++) {
            CK(cudaDeviceSynchronize());
            if (r == 1) t_start = unix_now();
            CK(cudaEventRecord(start, s0));
            CK(cudaStreamWaitEvent(s1, start, 0));
            d2h(out_kind, G, s0);
            h2d(in_kind, G, s1);
            CK(cudaEventRecord(e0, s0));
            CK(cudaEventRecord(e1, s1));
            CK(cudaDeviceSynchronize());
            CK(cudaGetLastError());
            float t0 = 0, t1 = 0;
            CK(cudaEventElapsedTime(&t0, start, e0));
            CK(cudaEventElapsedTime(&t1, start, e1));
            const float t = std::max(out_kind ? t0 : 0.f, in_kind ? t1 : 0.f);
            if (r > 0) gbps.push_back((double)S / (t * 1e-3) / 1e9);
        }
        const double t_end = unix_now();
        Row row{name, median(gbps), *std::min_element(gbps.begin(), gbps.end()),
                *std::max_element(gbps.begin(), gbps.end()), t_start, t_end, (double)S * REPS};
        printf("%-22s %7.2f GB/s per direction  (min %.2f, max %.2f)\n", name.c_str(), row.med, row.lo,
               row.hi);
        fflush(stdout);
        rows.push_back(row);
    };

    if (const char *at = getenv("START_AT")) {
        const auto when = std::chrono::system_clock::time_point(
            std::chrono::duration_cast<std::chrono::system_clock::duration>(
                std::chrono::duration<double>(atof(at))));
        if (std::chrono::system_clock::now() > when) fprintf(stderr, "START_AT already passed\n");
        std::this_thread::sleep_until(when);
    }
    run("ce-d2h", 'c', 0, 0);
    run("ce-h2d", 0, 'c', 0);
    run("ce-both", 'c', 'c', 0);
    for (int G : {16, 32, 64, 132}) {
        const std::string g = "/" + std::to_string(G);
        run("sm-store" + g, 's', 0, G);
        run("sm-load" + g, 0, 's', G);
        run("sm-both" + g, 's', 's', G);
        run("ce-d2h+sm-load" + g, 'c', 's', G);
        run("sm-store" + g + "+ce-h2d", 's', 'c', G);
    }

    if (const char *path = getenv("JSON")) {
        FILE *f = fopen(path, "w");
        if (!f) {
            perror(path);
            return 1;
        }
        fprintf(f, "{\"gpu\": \"%s\", \"bytes\": %zu, \"reps\": %d, \"rows\": [", p.name, S, REPS);
        for (size_t i = 0; i < rows.size(); i++)
            fprintf(f,
                    "%s\n {\"name\": \"%s\", \"gbps_median\": %.3f, \"gbps_min\": %.3f, \"gbps_max\": %.3f, "
                    "\"t_start\": %.6f, \"t_end\": %.6f, \"bytes\": %.0f}",
                    i ? "," : "", rows[i].name.c_str(), rows[i].med, rows[i].lo, rows[i].hi, rows[i].t_start,
                    rows[i].t_end, rows[i].bytes);
        fprintf(f, "\n]}\n");
        fclose(f);
    }
    return 0;
}
