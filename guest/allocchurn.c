/* allocchurn: a memory-churning allocator test. Keeps SLOTS allocations of random sizes
 * (16 B to 256 KiB, most small) and replaces random ones without pause: free, malloc, and
 * fill part of the new block (a header, a counter pattern, a stretch of random bytes), so
 * glibc's heap and its mmapped chunks are reused and returned all the time (about 36 MiB live).
 * Prints "alloc ops=N" once a second. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SLOTS 4096

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static size_t size_of(void) {
    uint64_t r = next() % 100;
    if (r < 70) return 16 + next() % 512;
    if (r < 95) return 512 + next() % 16384;
    return 16384 + next() % (256 * 1024);
}

int main(void) {
    static unsigned char *slot[SLOTS];
    static size_t len[SLOTS];
    uint64_t ops = 0;
    time_t last = time(NULL);
    printf("TANDEM-READY workload=alloc\n");
    fflush(stdout);
    for (;;) {
        size_t i = next() % SLOTS;
        free(slot[i]);
        len[i] = size_of();
        slot[i] = malloc(len[i]);
        if (!slot[i]) {
            len[i] = 0;
            continue;
        }
        memcpy(slot[i], &ops, sizeof ops < len[i] ? sizeof ops : len[i]);
        size_t fill = len[i] / (1 + next() % 4);
        for (size_t j = sizeof ops; j + 8 <= fill; j += 8) {
            uint64_t v = (j & 64) ? next() : ops + j;
            memcpy(slot[i] + j, &v, 8);
        }
        ops++;
        if ((ops & 1023) == 0 && time(NULL) != last) {
            last = time(NULL);
            printf("alloc ops=%llu\n", (unsigned long long)ops);
            fflush(stdout);
        }
    }
}
