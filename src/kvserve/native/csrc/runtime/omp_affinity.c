/*
 * Pin the calling thread's OpenMP team, one thread per given CPU (thread i on cpus[i]).
 *
 * libgomp keeps a thread pool per thread that opens parallel regions, and PyTorch's CPU ops
 * open theirs on the thread that calls them: so the thread that will run the engine's steps
 * calls this once, with torch's thread count equal to n.  Linked into the same library as
 * the decode kernel, against the OpenMP runtime torch already loaded.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

int bind_omp_threads(const int *cpus, int n) {
    int failed = 0;
    #pragma omp parallel num_threads(n)
    {
        int i = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[i], &set);
        if (omp_get_num_threads() != n || sched_setaffinity(0, sizeof set, &set) != 0) {
            #pragma omp atomic write
            failed = 1;
        }
    }
    return failed;
}
