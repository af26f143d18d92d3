/*
 * mpi-allreduce-bench: Open MPI's own measurement of the call that
 * "lowbit bench --backend mpi --collective allreduce" makes, to check the
 * busBW lowbit bench reports for it (scripts/mpi-allreduce-bench.sh).
 *
 * For each size (bytes of float32 data per rank, arguments 3 and on) it
 * times MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM,
 * MPI_COMM_WORLD) four ways:
 *
 *   nccl:      the nccl-tests way: after a barrier, ITERS calls back to
 *              back on one clock; a rank's time is the total over ITERS,
 *              and the time reported the mean of the ranks' (nccl-tests'
 *              -a 1);
 *   barrier:   the lowbit bench way: each call after a barrier, timed on
 *              its own; the time reported is the p50 (nearest rank) over
 *              every rank's ITERS calls;
 *   mean:      as barrier, each call followed by the division by W that
 *              lowbit bench's allreduce with --op mean (comm.Mean) makes
 *              after it, inside the time, as comm/mpi makes it: by a power
 *              of two W a multiplication by 1/W (the same numbers), else a
 *              division, in a loop the compiler vectorizes (build with
 *              -O3, as scripts/mpi-allreduce-bench.sh does);
 *   barrier16: as barrier, on a buffer 16 bytes past a page boundary.
 *
 * The buffer of the first three ways starts on a page boundary, as a Go
 * slice of more than 32 KiB does (lowbit bench's buffer, and a Go
 * program's gradients) and as the OSU micro-benchmarks allocate theirs;
 * barrier16's starts where glibc's malloc puts a block this large (mmap'd,
 * 16 bytes past a page boundary). On this project's machine (AMD EPYC,
 * Open MPI 4.1's shared memory with CMA) the same call on 64 MiB took up
 * to 1.4x as long on the page-aligned buffer, the kernel's copies between
 * the ranks' buffers taking most of the difference (docs/measured.md).
 *
 * algbw = size/time and busbw = algbw*2(W-1)/W, GB/s (decimal), as
 * nccl-tests computes them. Each way runs WARMUP untimed calls first. The
 * buffer is refilled before every call of the barrier way, untimed, as
 * lowbit bench does; the calls of the nccl way sum in place (values grow
 * by W per call; ITERS is capped so that they stay finite).
 *
 * usage: mpirun -np W mpi-allreduce-bench WARMUP ITERS SIZE...
 * Output, from rank 0, one CSV line per size and way (nccl, barrier, mean,
 * barrier16):
 *   way,bytes,count,time_us,algbw_gbps,busbw_gbps
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static void fill(float *buf, long n)
{
	for (long i = 0; i < n; i++)
		buf[i] = (float)((i % 1024) - 512) / 1024.0f;
}

/* divide divides buf[0..n) by w as comm/mpi's lb_divide does. */
static void divide(float *buf, long n, int w)
{
	float d = (float)w;
	if ((w & (w - 1)) == 0) {
		float r = 1.0f / d; /* exact: w is a power of two */
		for (long j = 0; j < n; j++)
			buf[j] *= r;
		return;
	}
	for (long j = 0; j < n; j++)
		buf[j] /= d;
}

static void report(const char *way, long bytes, double sec, int w)
{
	double algbw = (double)bytes / 1e9 / sec;
	double busbw = algbw * 2.0 * (w - 1) / w;
	printf("%s,%ld,%ld,%.3f,%.6f,%.6f\n", way, bytes, bytes / 4, sec * 1e6, algbw, busbw);
	fflush(stdout);
}

int main(int argc, char **argv)
{
	int rank, w;
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &w);
	if (argc < 4) {
		if (rank == 0)
			fprintf(stderr, "usage: mpi-allreduce-bench WARMUP ITERS SIZE...\n");
		MPI_Finalize();
		return 2;
	}
	int warmup = atoi(argv[1]), iters = atoi(argv[2]);
	if (warmup < 0 || iters < 1 || iters > 50) {
		if (rank == 0)
			fprintf(stderr, "mpi-allreduce-bench: want WARMUP >= 0 and 1 <= ITERS <= 50\n");
		MPI_Finalize();
		return 2;
	}
	double *times = malloc(sizeof(double) * iters);
	double *all = malloc(sizeof(double) * iters * w);
	if (rank == 0)
		printf("way,bytes,count,time_us,algbw_gbps,busbw_gbps\n");
	for (int a = 3; a < argc; a++) {
		long bytes = atol(argv[a]);
		long n = bytes / 4;
		if (n < 1 || n > 1L << 30) {
			if (rank == 0)
				fprintf(stderr, "mpi-allreduce-bench: bad size %s\n", argv[a]);
			MPI_Abort(MPI_COMM_WORLD, 2);
		}
		void *mem = NULL;
		if (posix_memalign(&mem, 4096, sizeof(float) * n + 4096) != 0)
			MPI_Abort(MPI_COMM_WORLD, 1);
		float *buf = mem;

		/* nccl-tests: back to back, total over iters, mean over ranks. */
		fill(buf, n);
		for (int i = 0; i < warmup; i++)
			MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
		fill(buf, n);
		MPI_Barrier(MPI_COMM_WORLD);
		double t0 = MPI_Wtime();
		for (int i = 0; i < iters; i++)
			MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
		double sec = (MPI_Wtime() - t0) / iters;
		MPI_Allreduce(MPI_IN_PLACE, &sec, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
		if (rank == 0)
			report("nccl", n * 4, sec / w, w);

		/*
		 * lowbit bench: a barrier before each call, p50 of all calls;
		 * then the same with the division of comm.Mean; then the first
		 * on a buffer 16 bytes past a page boundary.
		 */
		for (int way = 0; way <= 2; way++) {
			int mean = way == 1;
			if (way == 2)
				buf = (float *)((char *)mem + 16);
			for (int i = 0; i < warmup; i++) {
				fill(buf, n);
				MPI_Barrier(MPI_COMM_WORLD);
				MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
			}
			for (int i = 0; i < iters; i++) {
				fill(buf, n);
				MPI_Barrier(MPI_COMM_WORLD);
				double s = MPI_Wtime();
				MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
				if (mean)
					divide(buf, n, w);
				times[i] = MPI_Wtime() - s;
			}
			MPI_Gather(times, iters, MPI_DOUBLE, all, iters, MPI_DOUBLE, 0, MPI_COMM_WORLD);
			if (rank == 0) {
				int k = iters * w;
				qsort(all, k, sizeof(double), cmp_double);
				int i = (k + 1) / 2 - 1; /* nearest rank: ceil(0.5*k) - 1 */
				report(way == 0 ? "barrier" : way == 1 ? "mean" : "barrier16", n * 4, all[i], w);
			}
		}
		free(mem);
	}
	free(times);
	free(all);
	MPI_Finalize();
	return 0;
}
