/* MPI_Allreduce timing on float32 sum, the reference a host-backend user would otherwise pick.
 * Same method as `ipcreduce bench` on the host backend (crates/ipcreduce-cli/src/bench/host.rs):
 * back-to-back calls as OSU/IMB time them; a warm-up whose pace sets the calls per round
 * (enough for ROUND_SPAN, at least ITERS, at most MAX_CALLS, the most any rank asks for);
 * ROUNDS rounds, each a barrier then the calls timed as one span; per round the slowest rank's
 * mean per call; the row reports the median, minimum and maximum of the rounds. The input is
 * the same every call (as OSU), the output is poisoned before each round and the result of
 * the round's last call checked exactly (small integers: the float32 sum is exact).
 * Output: one CSV line per size on stdout, bytes,time_us,algbw_gbps,busbw_gbps,wrong (the form
 * `ipcreduce report` reads); with SPREAD_CSV, also there:
 *   bytes,time_us,algbw_gbps,busbw_gbps,wrong,min_us,max_us,calls_per_round
 * Usage: mpirun -n N mpi_allreduce MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP [SPREAD_CSV] */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROUNDS 7
#define ROUND_SPAN_S 10e-3
#define MAX_CALLS 20000

static float input(int rank, size_t i) {
    return (float)((int)((i * 2654435761u + (size_t)rank * 40503u) % 17u) - 8);
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    size_t min_b = argc > 1 ? strtoull(argv[1], 0, 10) : 8;
    size_t max_b = argc > 2 ? strtoull(argv[2], 0, 10) : (16u << 20);
    size_t factor = argc > 3 ? strtoull(argv[3], 0, 10) : 4;
    int iters = argc > 4 ? atoi(argv[4]) : 50;
    int warmup = argc > 5 ? atoi(argv[5]) : 10;
    if (warmup < 1) warmup = 1;
    size_t max_n = max_b / 4 ? max_b / 4 : 1;
    float *send = malloc(max_n * 4), *recv = malloc(max_n * 4);
    FILE *spread = rank == 0 && argc > 6 ? fopen(argv[6], "w") : NULL;
    if (rank == 0 && argc > 6 && !spread) {
        fprintf(stderr, "rank 0: cannot open %s\n", argv[6]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int failed = 0;
    for (size_t bytes = min_b; bytes <= max_b; bytes *= factor) {
        size_t n = bytes / 4 ? bytes / 4 : 1;
        for (size_t i = 0; i < n; i++) send[i] = input(rank, i);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int w = 0; w < warmup; w++)
            MPI_Allreduce(send, recv, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double pace = (MPI_Wtime() - t0) / warmup;
        long want_calls = (long)(ROUND_SPAN_S / (pace > 1e-9 ? pace : 1e-9)) + 1, calls;
        if (want_calls < iters) want_calls = iters;
        if (want_calls > MAX_CALLS) want_calls = MAX_CALLS;
        MPI_Allreduce(&want_calls, &calls, 1, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
        double rounds[ROUNDS];
        long wrong = 0, total;
        for (int r = 0; r < ROUNDS; r++) {
            memset(recv, 0xFF, n * 4);
            MPI_Barrier(MPI_COMM_WORLD);
            double s = MPI_Wtime();
            for (long it = 0; it < calls; it++)
                MPI_Allreduce(send, recv, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double mean = (MPI_Wtime() - s) / calls, worst;
            MPI_Allreduce(&mean, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            rounds[r] = worst * 1e6;
            for (size_t i = 0; i < n; i++) {
                float want = 0;
                for (int q = 0; q < world; q++) want += input(q, i);
                if (recv[i] != want) wrong++;
            }
        }
        MPI_Reduce(&wrong, &total, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            qsort(rounds, ROUNDS, sizeof(double), cmp);
            double us = rounds[ROUNDS / 2], alg = (double)(n * 4) / us / 1e3;
            double bus = alg * 2.0 * (world - 1) / world;
            printf("%zu,%.3f,%.3f,%.3f,%ld\n", n * 4, us, alg, bus, total);
            fflush(stdout);
            if (spread) {
                fprintf(spread, "%zu,%.3f,%.3f,%.3f,%ld,%.3f,%.3f,%ld\n", n * 4, us, alg, bus,
                        total, rounds[0], rounds[ROUNDS - 1], calls);
                fflush(spread);
            }
            if (total) failed = 1;
        }
    }
    if (spread) fclose(spread);
    free(send);
    free(recv);
    MPI_Finalize();
    return failed;
}
