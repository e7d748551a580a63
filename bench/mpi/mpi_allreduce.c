/* MPI_Allreduce timing on float32, the reference a host-backend user would otherwise pick.
 * Same method as `ipcreduce bench`: fresh inputs, poisoned output, warm-up, timed calls, the
 * result of the timed calls checked; time = the slowest rank's mean per call.
 * Output: one CSV line per size: bytes,time_us,algbw_gbps,busbw_gbps,wrong
 * Usage: mpirun -n N mpi_allreduce MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float input(int rank, size_t i) {
    /* Small integers: the sum is exact in float32, so checking needs no tolerance. */
    return (float)((int)((i * 2654435761u + (size_t)rank * 40503u) % 17u) - 8);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    size_t min_b = argc > 1 ? strtoull(argv[1], 0, 10) : 8;
    size_t max_b = argc > 2 ? strtoull(argv[2], 0, 10) : (8u << 20);
    size_t factor = argc > 3 ? strtoull(argv[3], 0, 10) : 4;
    int iters = argc > 4 ? atoi(argv[4]) : 20;
    int warmup = argc > 5 ? atoi(argv[5]) : 5;
    size_t max_n = max_b / 4 ? max_b / 4 : 1;
    float *send = malloc(max_n * 4), *recv = malloc(max_n * 4);
    int failed = 0;
    for (size_t bytes = min_b; bytes <= max_b; bytes *= factor) {
        size_t n = bytes / 4 ? bytes / 4 : 1;
        for (size_t i = 0; i < n; i++) send[i] = input(rank, i);
        memset(recv, 0xFF, n * 4);
        for (int w = 0; w < warmup; w++)
            MPI_Allreduce(send, recv, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        memset(recv, 0xFF, n * 4);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int it = 0; it < iters; it++)
            MPI_Allreduce(send, recv, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double dt = (MPI_Wtime() - t0) / iters, worst;
        MPI_Reduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        long wrong = 0, total;
        for (size_t i = 0; i < n; i++) {
            float want = 0;
            for (int r = 0; r < world; r++) want += input(r, i);
            if (recv[i] != want) wrong++;
        }
        MPI_Reduce(&wrong, &total, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double us = worst * 1e6, alg = (double)(n * 4) / us / 1e3;
            printf("%zu,%.3f,%.3f,%.3f,%ld\n", n * 4, us, alg, alg * 2.0 * (world - 1) / world, total);
            fflush(stdout);
            if (total) failed = 1;
        }
    }
    free(send);
    free(recv);
    MPI_Finalize();
    return failed;
}
